"""OpenAI's Batch API of the batch service: `POST /v1/batches`,
`GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`, `GET /v1/batches`.

Creating a batch checks its input file whole (inputs.py) while the request
waits -- the batch is returned `in_progress`, or `failed` with `errors` --
and stores its lines; the runner (runner.py) then owns and
runs it. Cancelling marks it `cancelling`; its owner stops its lines and
ends it `cancelled` with the lines done so far. Batches are scoped by
tenant like files (files_api.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.batch.callers import Callers
from services.batch.files_api import int_query, listing, not_found
from services.batch.inputs import ENDPOINTS, CheckedInput, check_input
from services.batch.records import Page, new_id
from services.batch.store import Database
from services.common.clock import Clock
from services.common.config.batch import BatchConfig
from services.common.openai_api.errors import ApiError, ErrorKind
from services.gateway.keys import Principal

__all__ = ["BatchesApi"]

ReadJson = Callable[[web.Request], Awaitable[Any]]
_WINDOWS = ("24h",)
_CANCELLABLE = ("validating", "in_progress", "finalizing")


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param)


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys <= 64, values <= 512 characters."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise _invalid("metadata: at most 16 string keys (<= 64 characters) with string values (<= 512)", "metadata")
    return value


class BatchesApi:
    def __init__(self, callers: Callers, db: Database, config: BatchConfig, clock: Clock,
                 read_json: ReadJson) -> None:
        self._callers = callers
        self._db = db
        self._config = config
        self._clock = clock
        self._read_json = read_json

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{batch_id}", self.retrieve)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    def _principal(self, request: web.Request) -> Principal:
        return self._callers.authenticate(request.headers)

    async def create(self, request: web.Request) -> web.Response:
        principal = self._principal(request)
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise _invalid("the body must be a JSON object", "body")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
            raise _invalid(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if not isinstance(window, str) or window not in _WINDOWS:
            raise _invalid(f"completion_window must be one of {', '.join(_WINDOWS)}", "completion_window")
        metadata = _metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise _invalid("input_file_id is required: the id of a file uploaded with purpose batch", "input_file_id")
        record = await self._db.run(self._db.store.get_file, principal.tenant, file_id)
        content = await self._db.run(self._db.store.file_content, principal.tenant, file_id)
        if record is None or content is None:
            raise not_found("file", file_id, "input_file_id")
        if record.purpose != "batch":
            raise _invalid(f"file {file_id} has purpose {record.purpose!r}, not 'batch'", "input_file_id")
        checked = await asyncio.to_thread(check_input, content, endpoint, self._config.max_lines)
        if checked.model is not None and not checked.errors:
            self._callers.check_model(principal, checked.model)  # 404 / 403
        batch = self._new_batch(file_id, endpoint, window, metadata, checked)
        lines = [] if checked.errors else checked.lines
        await self._db.run(self._db.store.create_batch, principal.tenant, principal.key_id, batch, lines)
        stored = await self._db.run(self._db.store.get_batch, principal.tenant, batch["id"])
        return web.json_response(stored)

    def _new_batch(self, file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None,
                   checked: CheckedInput) -> dict[str, Any]:
        now = int(self._clock.wall())
        batch: dict[str, Any] = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "model": checked.model,
            "errors": None, "input_file_id": file_id, "completion_window": window, "status": "in_progress",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
            "expires_at": now + int(self._config.completion_window_seconds), "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "metadata": metadata,
        }
        if checked.errors:
            batch.update(status="failed", in_progress_at=None, failed_at=now,
                         errors={"object": "list", "data": checked.errors})
        return batch

    async def retrieve(self, request: web.Request) -> web.Response:
        batch_id = request.match_info["batch_id"]
        batch = await self._db.run(self._db.store.get_batch, self._principal(request).tenant, batch_id)
        if batch is None:
            raise not_found("batch", batch_id)
        return web.json_response(batch)

    async def cancel(self, request: web.Request) -> web.Response:
        batch_id = request.match_info["batch_id"]
        tenant, now = self._principal(request).tenant, int(self._clock.wall())
        store = self._db.store
        changed = await self._db.run(store.update_batch, tenant, batch_id, _CANCELLABLE,
                                     {"status": "cancelling", "cancelling_at": now})
        batch = await self._db.run(store.get_batch, tenant, batch_id)
        if batch is None:
            raise not_found("batch", batch_id)
        if changed is None and batch["status"] not in ("cancelling", "cancelled"):
            raise ApiError(ErrorKind.CONFLICT, f"a batch with status {batch['status']} cannot be cancelled",
                               code="batch_not_cancellable")
        return web.json_response(batch)

    async def list(self, request: web.Request) -> web.Response:
        page = Page(request.query.get("after"), int_query(request, "limit", 20, 100))
        batches, more = await self._db.run(self._db.store.list_batches, self._principal(request).tenant, page)
        return web.json_response(listing(batches, more))
