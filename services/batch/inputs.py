"""A batch's input file, checked line by line when the batch is created
(as OpenAI does while the batch is `validating`).

- The file's shape -- each line a JSON object with a unique non-empty
  `custom_id`, `method` POST, `url` equal to the batch's endpoint, an object
  `body` naming the batch's one model -- decides whether the batch runs at
  all: any such error fails the batch with `errors` (the first `MAX_ERRORS`,
  each with its line number), and nothing runs.
- A body that is a well-formed line but not a valid request (the same
  checks `/v1/chat/completions` makes before admission) fails that line
  alone: its output line is a 400 in the error file, the others run.
Blank lines are skipped (line numbers stay the file's own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.batch.output import response_line
from services.common.openai_api.errors import ApiError, ErrorKind, http_error
from services.common.openai_api.requests import GenerationInput, parse_chat_body, parse_completion_body

__all__ = ["ENDPOINTS", "MAX_ERRORS", "CheckedInput", "check_input"]

# The batch endpoints kvmesh serves, with the body parser each uses.
ENDPOINTS: dict[str, Callable[[Any], GenerationInput]] = {
    "/v1/chat/completions": parse_chat_body,
    "/v1/completions": parse_completion_body,
}
MAX_ERRORS = 100


@dataclass
class CheckedInput:
    # (custom_id, body JSON, output line when refused already) per request.
    lines: list[tuple[str, str, str | None]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)   # OpenAI BatchError objects
    model: str | None = None

    def fail(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})


def check_input(content: bytes, endpoint: str, max_lines: int) -> CheckedInput:
    out = CheckedInput()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        out.fail(None, "invalid_file_format", "the input file is not UTF-8 text (JSONL)")
        return out
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            _check_line(out, number, raw, endpoint, seen)
        if len(out.lines) > max_lines:
            out.fail(None, "too_many_requests", f"the input file has more than {max_lines} requests "
                     "(batch.max_lines); split it into several batches")
            return out
    if not out.lines and not out.errors:
        out.fail(None, "empty_file", "the input file has no requests")
    return out


def _check_line(out: CheckedInput, number: int, raw: str, endpoint: str, seen: set[str]) -> None:
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError):
        out.fail(number, "invalid_json_line", "this line is not valid JSON")
        return
    if not isinstance(request, dict):
        out.fail(number, "invalid_json_line", "this line is not a JSON object")
        return
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        out.fail(number, "missing_required_parameter", "custom_id must be a non-empty string (at most 512 "
                 "characters)", "custom_id")
        return
    if custom_id in seen:
        out.fail(number, "duplicate_custom_id", f"custom_id {custom_id[:80]!r} is used by an earlier line; "
                 "each request needs its own", "custom_id")
        return
    seen.add(custom_id)
    if request.get("method") != "POST":
        out.fail(number, "invalid_method", "method must be \"POST\"", "method")
    elif request.get("url") != endpoint:
        out.fail(number, "invalid_url", f"url must be the batch's endpoint {endpoint!r}", "url")
    elif not isinstance(request.get("body"), dict):
        out.fail(number, "missing_required_parameter", "body must be a JSON object: the request", "body")
    elif not _same_model(out, number, request["body"].get("model")):
        return
    else:
        out.lines.append((custom_id, json.dumps(request["body"]), _body_error(custom_id, endpoint, request["body"])))


def _same_model(out: CheckedInput, number: int, model: Any) -> bool:
    if not isinstance(model, str) or not model:
        out.fail(number, "missing_required_parameter", "body.model is required", "body.model")
        return False
    if out.model is None:
        out.model = model
    elif model != out.model:
        out.fail(number, "model_mismatch", f"all requests of a batch use one model: this line asks for "
                 f"{model[:80]!r}, earlier lines for {out.model[:80]!r}", "body.model")
        return False
    return True


def _body_error(custom_id: str, endpoint: str, body: dict[str, Any]) -> str | None:
    """The 400 output line of a body that is no valid request, else None."""
    try:
        if body.get("stream"):
            raise ApiError(ErrorKind.INVALID_REQUEST, "a batch request is not streamed: remove \"stream\"",
                               param="stream")
        ENDPOINTS[endpoint](body)
    except ApiError as exc:
        error = http_error(exc)
        return response_line(custom_id, "", error.status, error.body)
    return None
