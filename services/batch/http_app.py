"""The batch service's HTTP API (aiohttp): the Files and Batches routes and
GET /health, behind one error boundary -- `_errors` turns every refusal
(an `ApiError`, aiohttp's own 404 / 405 / 413) into OpenAI error JSON, as
the gateway's API does for the same clients."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.batch.batches_api import BatchesApi
from services.batch.callers import Callers
from services.batch.files_api import FilesApi
from services.batch.store import Database
from services.common.clock import Clock
from services.common.config import MeshConfig
from services.common.openai_api.errors import ApiError, ErrorKind, error_response
from services.common.openai_api.requests import parse_json_body

__all__ = ["batch_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def batch_app(config: MeshConfig, callers: Callers, db: Database, clock: Clock,
              serving: Callable[[], bool]) -> web.Application:
    """The routes; `serving()` False (draining) makes GET /health a 503."""
    limit = config.gateway.max_body_bytes

    async def read_json(request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        return parse_json_body(await request.read())

    async def health(_: web.Request) -> web.Response:
        if not serving():
            raise ApiError(ErrorKind.UNAVAILABLE, "the batch service is draining", code="draining")
        return web.json_response({"status": "ok"})

    # The files route reads its multipart upload itself, bounded by batch.max_file_bytes.
    app = web.Application(middlewares=[_errors(limit)], client_max_size=config.batch.max_file_bytes + (1 << 16))
    FilesApi(callers, db, config.batch.max_file_bytes, clock).register(app)
    BatchesApi(callers, db, config.batch, clock, read_json).register(app)
    app.router.add_get("/health", health)
    return app


def _errors(max_body_bytes: int) -> Any:
    def refusal(request: web.Request, exc: web.HTTPException) -> ApiError:
        """aiohttp's own refusals (no route, wrong method, too large) in OpenAI's shape."""
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return ApiError(ErrorKind.BODY_TOO_LARGE, f"the request body is larger than {max_body_bytes} bytes; "
                            "send a smaller one", code="request_too_large")
        if exc.status == 404:
            return ApiError(ErrorKind.NOT_FOUND, f"no route {request.path}")
        return ApiError(ErrorKind.INVALID_REQUEST, f"{request.method} {request.path}: {exc.reason}")

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (ApiError, web.HTTPException) as exc:
            if isinstance(exc, ApiError):
                return error_response(exc)
            if exc.status < 400:   # a redirect: not a refusal
                raise
            response = error_response(refusal(request, exc))
            response.set_status(exc.status)
            return response

    return middleware
