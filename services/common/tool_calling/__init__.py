"""Tool calling, in one place: what a request's tool fields are, how the
tools and calls are written into the prompt, and how calls are read out of
the generated text and rendered for each API.

- request.py: `tools`, `tool_choice`, `parallel_tool_calls` and the
  history's tool fields -> normalized values or a 400; a forced choice's
  output constraint (`tool_call_schema`);
- call_format.py: which tools are offered and the format ("hermes" /
  "json") calls are written in -- decided once, for prompt and output;
- prompt.py: tools and the history's calls in the prompt, for a template
  that does not render them;
- parsers.py (+ call_json.py): calls read out of streamed text as events;
- chat_output.py: those events as OpenAI chat chunks and messages;
- grpc_mapping.py: the native gRPC API's tool fields in, its events out;
- responses_output.py: the Responses API's text / tool-call pieces.

Here in common rather than in the gateway because an engine's own OpenAI
endpoint parses the same request fields and renders the history's tool
calls into its prompt (services/common/openai_api/requests.py,
services/common/tokenizer.py); reading calls out of the text is the
gateway's alone (an engine's endpoint refuses `tools`).
"""
