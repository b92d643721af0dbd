"""OpenAI's Files API of the batch service, for batch input and output:
`POST /v1/files` (multipart: `purpose=batch`, `file`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

Files live in the batch database (store.py), scoped by tenant:
another tenant's id is answered 404 like one that never existed. An upload
is counted as it arrives and refused with 413 past `batch.max_file_bytes`
(Envoy's request body limit is lifted on this route alone; the batch
service's JSON body limit, `gateway.max_body_bytes`, applies to JSON bodies,
not to this multipart stream).
Its lines are checked when a batch is created from it (inputs.py).
"""

from __future__ import annotations

from typing import Any

from aiohttp import BodyPartReader, web

from services.batch.callers import Callers
from services.batch.records import Page
from services.batch.store import Database
from services.common.clock import Clock
from services.common.openai_api.errors import ApiError, ErrorKind

__all__ = ["FilesApi", "int_query", "listing", "not_found"]

_CHUNK = 1 << 16
_PURPOSES = ("batch",)   # the purposes a client may upload; outputs are `batch_output`


def not_found(what: str, object_id: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.NOT_FOUND, f"No such {what}: {object_id[:80]!r}", param=param,
                        code=f"{what}_not_found")


def int_query(request: web.Request, name: str, default: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 1 <= int(raw) <= high:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"{name} must be an integer within 1 .. {high}", param=name)
    return int(raw)


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


class FilesApi:
    def __init__(self, callers: Callers, db: Database, max_file_bytes: int, clock: Clock) -> None:
        self._callers = callers
        self._db = db
        self._max_bytes = max_file_bytes
        self._clock = clock

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.create)
        app.router.add_get("/v1/files", self.list)
        app.router.add_get("/v1/files/{file_id}", self.retrieve)
        app.router.add_get("/v1/files/{file_id}/content", self.content)
        app.router.add_delete("/v1/files/{file_id}", self.delete)

    def _tenant(self, request: web.Request) -> str:
        return self._callers.authenticate(request.headers).tenant

    def _too_large(self) -> ApiError:
        return ApiError(ErrorKind.BODY_TOO_LARGE, f"the file is larger than {self._max_bytes} bytes "
                            "(batch.max_file_bytes); split it into several batches", param="file",
                            code="file_too_large")

    async def create(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        if request.content_length is not None and request.content_length > self._max_bytes + _CHUNK:
            raise self._too_large()
        if not request.content_type.startswith("multipart/"):
            raise ApiError(ErrorKind.INVALID_REQUEST, "upload a file as multipart/form-data with fields "
                               "`purpose` and `file`", param="file")
        try:
            purpose, filename, content = await self._read_form(request)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - aiohttp's multipart reader on a malformed body, whatever it raises
            raise ApiError(ErrorKind.INVALID_REQUEST, f"the multipart body is malformed: {exc}"[:300],
                               param="file") from None
        if purpose not in _PURPOSES:
            raise ApiError(ErrorKind.INVALID_REQUEST, f"purpose must be one of {', '.join(_PURPOSES)}, "
                               f"got {purpose!r}", param="purpose")
        if content is None:
            raise ApiError(ErrorKind.INVALID_REQUEST, "the form has no `file` field", param="file",
                               code="missing_required_parameter")
        record = await self._db.run(self._db.store.put_file, tenant, purpose, filename, content,
                                    int(self._clock.wall()))
        return web.json_response(record.object())

    async def _read_form(self, request: web.Request) -> tuple[str | None, str, bytes | None]:
        purpose: str | None = None
        filename, content = "upload.jsonl", None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":  # a short word: read at most one chunk of it
                purpose = (await part.read_chunk(256))[:64].decode(errors="replace").strip()
                await part.release()
            elif part.name == "file":
                filename = (part.filename or filename)[:255]
                chunks, size = [], 0
                while chunk := await part.read_chunk(_CHUNK):
                    size += len(chunk)
                    if size > self._max_bytes:
                        raise self._too_large()
                    chunks.append(chunk)
                content = b"".join(chunks)
            else:
                await part.release()
        return purpose, filename, content

    async def list(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(ErrorKind.INVALID_REQUEST, "order must be asc or desc", param="order")
        page = Page(request.query.get("after"), int_query(request, "limit", 10000, 10000), order == "desc")
        records, more = await self._db.run(self._db.store.list_files, tenant, request.query.get("purpose"), page)
        return web.json_response(listing([r.object() for r in records], more))

    async def retrieve(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        record = await self._db.run(self._db.store.get_file, self._tenant(request), file_id)
        if record is None:
            raise not_found("file", file_id)
        return web.json_response(record.object())

    async def content(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        content = await self._db.run(self._db.store.file_content, self._tenant(request), file_id)
        if content is None:
            raise not_found("file", file_id)
        return web.Response(body=content, content_type="application/octet-stream")

    async def delete(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        if not await self._db.run(self._db.store.delete_file, self._tenant(request), file_id):
            raise not_found("file", file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})
