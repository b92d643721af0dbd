"""A generation's events as an SSE response, for both HTTP transports that
stream (chat/completions in http_api.py, `/v1/responses` in
responses_api.py): each renders an event to bytes, this writes them.

The response starts lazily -- at the first token, the first heartbeat or the
end -- so a request the scheduler refuses quickly still gets its real
429/503 status, while a long wait in the queue keeps the connection alive.
Once started, a failure is rendered into the stream (`fail`), and a client
that went away ends it quietly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from services.common.openai_api.completions_output import SSE_HEARTBEAT
from services.gateway.errors import GatewayError
from services.gateway.events import Event, Finished, Heartbeat, TextDelta
from services.gateway.pipeline import Generation

__all__ = ["relay_sse"]

log = logging.getLogger(__name__)

# An event's bytes; None: nothing to send and no reason to start (a queue position).
Render = Callable[[Event], bytes | None]


class _LazySse:
    """An SSE response prepared at its first write, `opening` sent first."""

    def __init__(self, request: web.Request, headers: Mapping[str, str], opening: bytes) -> None:
        self._request = request
        self._headers = headers
        self._opening = opening
        self.response: web.StreamResponse | None = None

    async def write(self, data: bytes) -> web.StreamResponse:
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                **self._headers})
            await self.response.prepare(self._request)
            data = self._opening + data
        if data:
            await self.response.write(data)
        return self.response


async def relay_sse(request: web.Request, stream: Generation, opening: bytes, render: Render,
                    fail: Callable[[GatewayError], bytes],
                    before_end: Callable[[], Awaitable[None]] | None = None) -> web.StreamResponse:
    """Write `stream`'s events rendered; `opening` goes first when the
    response starts; a text delta that wrote something marks output (the
    stream's pacing signal). `before_end` is awaited once the Finished event
    is rendered, before it is written (the Responses store keeps a response
    before its client sees it end)."""
    out = _LazySse(request, stream.headers, opening)
    try:
        async for event in stream:
            data = SSE_HEARTBEAT if isinstance(event, Heartbeat) else render(event)
            if before_end is not None and isinstance(event, Finished):
                await before_end()
            if data is None:
                continue
            await out.write(data)
            if data and isinstance(event, TextDelta):
                stream.mark_output()
    except GatewayError as exc:
        if out.response is None:
            raise
        await out.response.write(fail(exc))
    except ConnectionResetError:
        log.info("request %s: client went away", stream.job.request_id)
        if out.response is None:
            raise
        return out.response
    response = await out.write(b"")
    await response.write_eof()
    return response
