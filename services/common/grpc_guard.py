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

__all__ = ["RejectUndecodable", "UndecodableMessage", "WrappingInterceptor"]


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


def _wrap(behavior: Callable[..., Any], parse: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Any:
    """`behavior(request, context)` with the request passed through `parse`
    first and UndecodableMessage turned into INVALID_ARGUMENT; the result
    keeps the behavior's style (coroutine or async generator)."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in behavior(await parse(request, context), context):
                    yield item
            except UndecodableMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = behavior(await parse(request, context), context)
            return await result if inspect.isawaitable(result) else result
        except UndecodableMessage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return call


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserializer = handler.request_deserializer
    if deserializer is None:
        return handler
    what = _what(handler)
    if handler.request_streaming:
        async def passthrough(request: Any, _context: grpc.aio.ServicerContext) -> Any:
            return request

        behavior = handler.stream_stream or handler.stream_unary
        wrapped = _wrap(behavior, passthrough)
        factory = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                   else grpc.stream_unary_rpc_method_handler)
        return factory(wrapped, request_deserializer=_safe(deserializer, what),
                       response_serializer=handler.response_serializer)

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(what, exc))

    behavior = handler.unary_stream or handler.unary_unary
    wrapped = _wrap(behavior, parse)
    factory = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
               else grpc.unary_unary_rpc_method_handler)
    return factory(wrapped, request_deserializer=None, response_serializer=handler.response_serializer)


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Serves each method through `wrap(method, handler)`, computed once per
    method (and again only if the server hands out a different handler)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
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

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:  # noqa: ARG002
        return _guard(handler)
