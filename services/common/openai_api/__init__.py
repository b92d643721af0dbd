"""The OpenAI-compatible surface both front doors serve — the gateway's HTTP
API and an engine's own HTTP endpoint — written once:

- `requests`: request bodies -> validated `GenerationInput` records (or a 400),
- `responses`: completion / chunk / usage shapes and SSE framing,
- `errors`: the closed `ErrorKind`, `ApiError` and OpenAI's error JSON.

What each front door adds (keys, limits and the scheduler at the gateway; the
runtime and peer-router endpoints at the engine) stays in its own service.
"""
