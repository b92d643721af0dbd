"""The OpenAI-compatible surface both front doors serve — the gateway's HTTP
API and an engine's own HTTP endpoint — written once:

- `requests`: request bodies -> validated `GenerationInput` records (or a 400),
- `completions_output`: chat.completion / text_completion / chunk / usage
  shapes and SSE framing,
- `responses_events`: the Responses API's response object and stream events,
- `structured_outputs`: output constraints (`response_format`,
  `structured_outputs`) -> a checked `StructuredSpec`,
- `errors`: the closed `ErrorKind`, `ApiError` and OpenAI's error JSON.

What each front door adds (keys, limits and the scheduler at the gateway; the
runtime and peer-router endpoints at the engine) stays in its own service.
"""
