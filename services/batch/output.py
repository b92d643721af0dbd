"""OpenAI's batch output lines and the output / error files built from them.

A line's output (one JSON line, `{id, custom_id, response, error}`):
- the request ran: `response` = {status_code, request_id, body} -- 200 with
  the completion as `/v1/chat/completions` would have answered it, or the
  HTTP error status with its OpenAI error body -- and `error` null;
- it never ran (the batch expired or was cancelled first): `response` null
  and `error` = {code, message}.
Status 200 lines make the output file; all others the error file. Lines in
input order, exactly one per custom_id.
"""

from __future__ import annotations

import json
from typing import Any

from services.batch.records import new_id

__all__ = ["NOT_RUN", "files_of", "not_run_line", "response_line"]

# Why a line that never ran has no response: the batch's final status -> (code, message).
NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
    "failed": ("batch_failed", "This request was not executed: the batch failed."),
}


def response_line(custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> str:
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body},
                       "error": None}, separators=(",", ":"))


def not_run_line(custom_id: str, status: str) -> str:
    code, message = NOT_RUN.get(status, NOT_RUN["failed"])
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, separators=(",", ":"))


def files_of(outputs: list[tuple[str, str | None, bool]], status: str) -> list[tuple[str, bytes]]:
    """The batch's files from its lines' (custom_id, output, ok): a list of
    (batch field, content) -- only the files that have a line, as OpenAI
    leaves `output_file_id` / `error_file_id` null for an empty one."""
    good: list[str] = []
    bad: list[str] = []
    for custom_id, output, ok in outputs:
        if output is None:
            bad.append(not_run_line(custom_id, status))
        else:
            (good if ok else bad).append(output)
    files = []
    if good:
        files.append(("output_file_id", ("\n".join(good) + "\n").encode()))
    if bad:
        files.append(("error_file_id", ("\n".join(bad) + "\n").encode()))
    return files
