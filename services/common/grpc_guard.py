"""Bytes that do not parse as the method's request message get
INVALID_ARGUMENT, not UNKNOWN.

grpcio parses a request with the method's deserializer before (unary) or
inside (`context.read()`, streams) the handler; a `DecodeError` (corrupt
wire format, or a proto3 string that is not UTF-8) then escapes as
"UNKNOWN: Unexpected <class DecodeError>" -- a server fault by the look of
it, though the client sent garbage. This interceptor, installed by
`make_server` on every kvmesh server, parses unary requests itself and
aborts with INVALID_ARGUMENT naming the message type, and for streamed
requests turns the failed parse into `UndecodableMessage`, which aborts the
call the same way unless the handler dealt with it (a reader that treats
any read error as the client leaving, say).

Per RPC it costs one dict lookup and one extra coroutine frame.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["RejectUndecodable", "UndecodableMessage", "WrappingInterceptor", "rebuild_handler", "wrap_behavior"]


class UndecodableMessage(ValueError):
    """A streamed request message did not parse as the method's type."""


def _what(handler: grpc.RpcMethodHandler) -> str:
    owner = getattr(handler.request_deserializer, "__self__", None)
    name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "") or getattr(owner, "__name__", "")
    return name or "request message"


def _message(what: str, exc: Exception) -> str:
    return f"the request is not a valid {what} protobuf message ({exc}); send one encoded with the .proto"


def _safe(deserializer: Callable[[bytes], Any], what: str) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, non-UTF-8 strings, ...
            raise UndecodableMessage(_message(what, exc)) from exc
    return parse


def wrap_behavior(
    behavior: Callable[..., Any], before: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
) -> Any:
    """`behavior(request, context)` with the request passed through `before`
    first (which may abort the call) and UndecodableMessage turned into
    INVALID_ARGUMENT; the result keeps the behavior's style (coroutine or
    async generator)."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in behavior(await before(request, context), context):
                    yield item
            except UndecodableMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = behavior(await before(request, context), context)
            return await result if inspect.isawaitable(result) else result
        except UndecodableMessage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return call


def rebuild_handler(
    handler: grpc.RpcMethodHandler,
    before: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """`handler` of the same streaming kind, its behavior behind `before`
    (`wrap_behavior`), with `request_deserializer`."""
    streaming = (handler.request_streaming, handler.response_streaming)
    behavior: Callable[..., Any] | None = {
        (False, False): handler.unary_unary, (False, True): handler.unary_stream,
        (True, False): handler.stream_unary, (True, True): handler.stream_stream,
    }[streaming]
    if behavior is None:
        # grpcio builds handlers with the behavior of their streaming kind set.
        raise TypeError(f"{handler!r} has no behavior for request/response streaming {streaming}")
    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
    }[streaming]
    return factory(wrap_behavior(behavior, before), request_deserializer=request_deserializer,
                   response_serializer=handler.response_serializer)


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserializer = handler.request_deserializer
    if deserializer is None:
        return handler
    what = _what(handler)
    if handler.request_streaming:
        async def passthrough(request: Any, _context: grpc.aio.ServicerContext) -> Any:
            return request

        return rebuild_handler(handler, passthrough, _safe(deserializer, what))

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(what, exc))

    return rebuild_handler(handler, parse, None)


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Serves each method through `wrap(method, handler)`, computed once per
    method (and again only if the server hands out a different handler)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class RejectUndecodable(WrappingInterceptor):
    """Parses requests itself; see the module docstring."""

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return _guard(handler)
