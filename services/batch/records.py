"""The Batch API's records as the store hands them out, and OpenAI's object
shapes built from them (openai/types/file_object.py, batch.py)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

__all__ = ["ACTIVE", "FINAL", "FileRecord", "LineRecord", "Page", "new_id"]

# Statuses an owner drives (the lease matters); FINAL ones never change again.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `file-…`, `batch_…`, `batch_req_…`."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Page:
    """A list request's cursor: rows after the id `after` (exclusive)."""

    after: str | None
    limit: int
    newest_first: bool = True


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


@dataclass(frozen=True)
class LineRecord:
    """One request of a batch: `state` pending -> running (an owner admitted
    it under `request_id`, in `epoch`) -> done (its output line recorded)."""

    batch_id: str
    line: int            # 1-based line number in the input file
    custom_id: str
    body: str            # the request body, JSON
    state: str
    attempt: int
    request_id: str
    epoch: int

    def request(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.body)
        return body
