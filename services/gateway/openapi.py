"""The OpenAPI 3 document of the gateway's HTTP routes (GET /openapi.json)."""

from __future__ import annotations

from typing import Any

__all__ = ["openapi_document"]


def _error_responses(*codes: int) -> dict[str, Any]:
    names = {
        400: "Invalid request (the message names the parameter)",
        401: "Missing or invalid API key",
        403: "The key may not use this model",
        404: "Unknown model or route",
        413: "Body larger than gateway.max_body_bytes",
        429: "Rate limit or queue full; see Retry-After",
        503: "No engine, scheduler unreachable or draining; see Retry-After",
    }
    return {
        str(c): {"description": names[c],
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for c in codes
    }


# Output constraints (services/common/openai_api/response_format.py): at most one per request.
_STRUCTURED: dict[str, Any] = {
    "response_format": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    "structured_outputs": {
        "type": "object", "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object",
        "properties": {"json": {"oneOf": [{"type": "object"}, {"type": "string"}]}, "regex": {"type": "string"},
                       "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                       "grammar": {"type": "string"}, "json_object": {"type": "boolean", "enum": [True]}}},
}

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0, "maximum": 2},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "n": {"type": "integer", "minimum": 1, "maximum": 8},
    "logit_bias": {"type": "object", "maxProperties": 300,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    **_STRUCTURED,
}

# Tool calling (services/common/openai_api/tools.py).
_CALL = {"type": "object", "required": ["id", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_TOOL_MESSAGE = {"tool_calls": {"type": "array", "items": _CALL}, "tool_call_id": {"type": "string"}}
_TOOLS = {
    "tools": {"type": "array", "maxItems": 128, "items": {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"type": "string", "enum": ["function"]}, "function": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                           "description": {"type": "string"}, "parameters": {"type": "object"},
                           "strict": {"type": "boolean"}}}}}},
    "tool_choice": {"oneOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean"},
}

_GEN_PARAMS = [
    {"name": "X-Priority", "in": "header", "required": False,
     "description": "Scheduling class 0 (interactive), 1 (default), 2 (batch); capped by the key's ceiling.",
     "schema": {"type": "integer", "enum": [0, 1, 2]}},
    {"name": "x-request-id", "in": "header", "required": False,
     "description": "Request id used in logs, the scheduler and the engine; generated if absent.",
     "schema": {"type": "string", "maxLength": 128}},
]

_STREAM_OR_JSON = {
    "200": {
        "description": "The completion (JSON), or with stream=true an SSE stream of chunks ending in data: [DONE]",
        "content": {"application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {"type": "string"}}},
    }
}


def _schemas() -> dict[str, Any]:
    message = {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                       "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                       **_TOOL_MESSAGE},
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True},
            }}},
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                "model": {"type": "string"},
                "messages": {"type": "array", "minItems": 1, "items": message},
                "max_completion_tokens": {"type": "integer", "minimum": 1},
                "logprobs": {"type": "boolean"},
                "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                **_TOOLS,
                **_SAMPLING,
            },
        },
        "ResponseRequest": {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": {"type": "string"},
                "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                "instructions": {"type": "string"},
                "max_output_tokens": {"type": "integer", "minimum": 1},
                "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                "tools": {"type": "array", "items": {"type": "object"}},
                "store": {"type": "boolean"}, "previous_response_id": {"type": "string"},
                "stream": {"type": "boolean"},
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                "model": {"type": "string"},
                "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
                "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
                "echo": {"type": "boolean"},
                **_SAMPLING,
            },
        },
    }


def _generation(summary: str, schema: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "parameters": _GEN_PARAMS,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {**_STREAM_OR_JSON, **_error_responses(400, 401, 403, 404, 413, 429, 503)},
    }}


def _json_get(summary: str, description: str, errors: tuple[int, ...], **extra: Any) -> dict[str, Any]:
    return {"get": {
        "summary": summary,
        **extra,
        "responses": {"200": {"description": description,
                              "content": {"application/json": {"schema": {"type": "object"}}}},
                      **_error_responses(*errors)},
    }}


def _json_post(summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {"200": {"description": "JSON", "content": {"application/json": {"schema": {"type": "object"}}}},
                      **_error_responses(400, 401, 403, 404)},
    }}


def _paths() -> dict[str, Any]:
    return {
        "/v1/chat/completions": _generation(
            "Chat completion (OpenAI chat.completion / chat.completion.chunk)", "ChatCompletionRequest"),
        "/v1/completions": _generation("Text completion (OpenAI text_completion)", "CompletionRequest"),
        "/v1/responses": _generation("Responses API (OpenAI response; stream: typed events)", "ResponseRequest"),
        "/v1/responses/{response_id}": _json_get(
            "A response created with store: true (this gateway, this key, within responses.ttl_seconds)",
            "OpenAI response object", (401, 404),
            parameters=[{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]),
        "/v1/models": _json_get("Models this key may use that some engine serves now", "OpenAI model list",
                                (401,)),
        "/v1/models/{model}": _json_get(
            "One model", "OpenAI model object", (401, 403, 404),
            parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
        **_batch_paths(),
        "/tokenize": _json_post("Token ids of a prompt or chat, with the gateway's tokenizer (vLLM's /tokenize)"),
        "/detokenize": _json_post("Text of token ids (vLLM's /detokenize)"),
        "/health": _json_get("200 only while the scheduler is reachable", "ready", (503,), security=[]),
        "/openapi.json": _json_get("This document", "OpenAPI 3 document", (), security=[]),
    }


def _batch_paths() -> dict[str, Any]:
    """The Files + Batch API: the batch service's (services/batch/), behind Envoy (README "The Batch API")."""
    def path_id(name: str) -> dict[str, Any]:
        return {"parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]}
    upload = {"post": {
        "summary": "Upload a JSONL batch input (multipart: purpose=batch, file); 413 over batch.max_file_bytes",
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {"type": "object"}}}},
        "responses": {"200": {"description": "OpenAI file object",
                              "content": {"application/json": {"schema": {"type": "object"}}}},
                      **_error_responses(400, 401, 413)},
    }}
    return {
        "/v1/files": {**upload, **_json_get("This tenant's files (after, limit, order, purpose)", "file list",
                                            (401,))},
        "/v1/files/{file_id}": _json_get("A file (404: unknown or another tenant's)", "OpenAI file object",
                                         (401, 404), **path_id("file_id")),
        "/v1/files/{file_id}/content": _json_get("A file's content", "the file's bytes", (401, 404),
                                                 **path_id("file_id")),
        "/v1/batches": {**_json_post("Create a batch from an uploaded file (endpoint, completion_window 24h)"),
                        **_json_get("This tenant's batches, newest first (after, limit)", "batch list", (401,))},
        "/v1/batches/{batch_id}": _json_get("A batch with its request counts", "OpenAI batch object", (401, 404),
                                            **path_id("batch_id")),
        "/v1/batches/{batch_id}/cancel": {"post": {**_json_post("Cancel a batch")["post"], **path_id("batch_id")}},
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvmesh gateway", "version": "1.0.0",
                 "description": "OpenAI-compatible API served by the kvmesh gateway."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(),
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
    }
