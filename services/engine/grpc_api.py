"""`kvmesh.v1.Engine` over gRPC: Generate (bidi), Abort, GetInfo.

The one place engine errors become gRPC status codes:
InvalidRequest -> INVALID_ARGUMENT, DuplicateRequest -> ALREADY_EXISTS,
NotAccepting (starting / draining / stopping) -> UNAVAILABLE, and a
generation handed over by a stopping engine (drain timeout) -> UNAVAILABLE
mid-stream, which the gateway answers by migrating the stream.

Generate runs two tasks: this handler writes outputs, and a reader task
watches the client's side for a `cancel`. With grpc.aio a client cancelling
the call while the server reads looks like a half-close (the read returns
EOF), so EOF is never taken as "stop": the generation goes on until it
finishes, a `cancel` arrives, or the call is cancelled -- which grpc.aio
delivers by cancelling this handler. Its `finally` then ends the generation
-- after a polite `cancel`, or once the final output went out -- or, when
the call just broke (the gateway died or its link did), keeps it DETACHED
for a resume (detached.py): a later call whose first message is `resume`
re-attaches to it, gets `resumed`, every delta from the first, then the rest
live. Unknown id -> NOT_FOUND; other prompt -> INVALID_ARGUMENT; a call
superseded by a resume ends ABORTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

import grpc

from services.common.finish_reason import FinishReason
from services.common.idle_calls import IdleCalls
from services.common.openai_api.structured_outputs import structured_from_proto
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.tracing import NO_SPAN, NO_TRACING, Span, Tracing
from services.engine import generate_trace
from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest, Sampling
from services.engine.detached import Attachment, UnknownGeneration
from services.engine.errors import DuplicateRequest, NotAccepting
from services.engine.generate_many import GenerateManyCall
from services.engine.runtime import EngineRuntime, Generation

__all__ = ["EngineServicer", "request_from_proto"]

log = logging.getLogger(__name__)

# How long a finished generation's call waits for the gateway's
# acknowledgement (`ack_final`) before it counts as delivered.
_ACK_WAIT_SECONDS = 30.0


def request_from_proto(msg: engine_pb2.EngineRequest) -> GenerationRequest:
    s = msg.sampling

    # Optional (proto3 `optional`) fields: None when unset.
    def opt_float(name: str) -> float | None:
        return cast(float, getattr(s, name)) if s.HasField(name) else None

    def opt_int(name: str) -> int | None:
        return cast(int, getattr(s, name)) if s.HasField(name) else None

    sampling = Sampling(
        max_tokens=s.max_tokens,
        temperature=opt_float("temperature"), top_p=opt_float("top_p"), top_k=opt_int("top_k"),
        min_p=opt_float("min_p"),
        min_tokens=s.min_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        seed=opt_int("seed"), presence_penalty=opt_float("presence_penalty"),
        frequency_penalty=opt_float("frequency_penalty"),
        repetition_penalty=opt_float("repetition_penalty"),
        logprobs=opt_int("logprobs"), ignore_eos=s.ignore_eos, logit_bias=dict(s.logit_bias),
        structured=structured_from_proto(s),
    )
    return GenerationRequest(
        request_id=msg.request_id, prompt_token_ids=list(msg.prompt_token_ids), sampling=sampling,
        priority=msg.priority, resumed_tokens=msg.resumed_tokens, scheduler_replica=msg.scheduler_replica,
    )


def _delta(out: GenerationOutput) -> engine_pb2.EngineGenerateEvent:
    delta = engine_pb2.EngineDelta(token_ids=out.token_ids, text=out.text, held_text=out.held_text)
    for lp in out.logprobs or ():
        delta.logprobs.add(
            token_id=lp.get("token_id", 0), token=lp.get("token", ""), logprob=lp.get("logprob", 0.0),
            top=[common_pb2.TopLogprob(token_id=t.get("token_id", 0), token=t.get("token", ""),
                                       logprob=t.get("logprob", 0.0)) for t in lp.get("top", ())],
        )
    return engine_pb2.EngineGenerateEvent(delta=delta)


def _finished(out: GenerationOutput) -> engine_pb2.EngineGenerateEvent:
    return engine_pb2.EngineGenerateEvent(finished=engine_pb2.EngineFinished(
        finish_reason=FinishReason.parse(out.finish_reason).to_proto(),
        usage=common_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                               cached_tokens=out.cached_tokens),
        message=out.message,
    ))


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, runtime: EngineRuntime, engine_id: str, backend_name: str,
                 tracing: Tracing = NO_TRACING) -> None:
        self._runtime = runtime
        self._tracing = tracing  # `engine.generate` spans (generate_trace.py)
        self._engine_id = engine_id
        self._backend_name = backend_name
        # Generate calls gateways opened ahead of their next request.
        self.idle_calls = IdleCalls()
        # Open GenerateMany calls (generate_many.py), told when the engine stops.
        self._many_calls: set[GenerateManyCall] = set()

    def close_calls(self) -> None:
        """The engine stops taking work: idle calls end now, GenerateMany
        calls once their streams have ended."""
        self.idle_calls.close()
        for call in self._many_calls:
            call.close()

    async def GenerateMany(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        """Many Generate streams over one call, each served by `Generate`."""
        call = GenerateManyCall(self.Generate, context)
        self._many_calls.add(call)
        if self.idle_calls.closed:
            call.close()
        try:
            await call.serve()
        finally:
            self._many_calls.discard(call)

    async def Generate(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await self.idle_calls.first_message(context)
        if first is grpc.aio.EOF or first.WhichOneof("msg") not in ("request", "resume"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the first Generate message must be `request` or `resume`")
        call = first.request if first.WhichOneof("msg") == "request" else first.resume
        span = generate_trace.start(self._tracing, self._engine_id, call, context)
        try:
            if isinstance(call, engine_pb2.ResumeGeneration):
                await self._resume(call, context, span)
            else:
                await self._start(call, context, span)
        except BaseException as exc:
            generate_trace.failed(span, exc)
            raise
        finally:
            span.end()

    async def _start(self, request: engine_pb2.EngineRequest, context: grpc.aio.ServicerContext,
                     span: Span) -> None:
        generation = await self._open(request, context, span)
        generation.delta_offset = request.delta_offset
        generation.ack_final = request.ack_final
        # One line per request, keyed by the gateway's id (x-request-id).
        log.info("request %s started (%d prompt tokens, priority %d)%s", request.request_id,
                 len(request.prompt_token_ids), request.priority,
                 f" trace={span.trace_id}" if span.trace_id else "")
        await self._serve(generation, context, None, span)

    async def _open(self, msg: engine_pb2.EngineRequest, context: grpc.aio.ServicerContext,
                    span: Span = NO_SPAN) -> Generation:
        for attempt in range(2):
            try:
                request = request_from_proto(msg)
                if span is not NO_SPAN:  # vLLM's own span continues this one
                    request.trace_headers = span.carrier()
                return self._runtime.open(request)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except DuplicateRequest as exc:
                if attempt or not await self._runtime.kept.make_way(msg.request_id):
                    await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
            except NotAccepting as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise AssertionError("unreachable: the second attempt returns or aborts")

    async def _resume(self, msg: engine_pb2.ResumeGeneration, context: grpc.aio.ServicerContext,
                      span: Span = NO_SPAN) -> None:
        try:
            generation = self._runtime.kept.find(msg.request_id, list(msg.prompt_token_ids))
        except UnknownGeneration as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request = generation.request
        resumed = engine_pb2.EngineResumed(
            prior_token_ids=request.prompt_token_ids[len(msg.prompt_token_ids):],
            delta_offset=generation.delta_offset)
        await self._serve(generation, context, resumed, span)

    async def _serve(self, generation: Generation, context: grpc.aio.ServicerContext,
                     resumed: engine_pb2.EngineResumed | None, span: Span = NO_SPAN) -> None:
        """Own `generation` for this call (detached.py): replay (a resume),
        stream, and on the way out end it, keep it, or leave it be."""
        mine = await self._runtime.kept.attach(generation)
        reader = asyncio.create_task(self._read_cancel(context, generation, mine))
        delivered = False
        try:
            if resumed is None or not await self._replay(generation, context, resumed):
                await self._stream(generation, context, span)
            delivered = not generation.ack_final or await self._acknowledged(reader, mine)
        except grpc.aio.AbortError:
            delivered = True
            raise
        except asyncio.CancelledError:
            if not mine.superseded:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            delivered = True
            await context.abort(grpc.StatusCode.ABORTED, "this stream was resumed by another call")
        finally:
            reader.cancel()
            self._runtime.kept.leave(generation, mine, delivered)

    @staticmethod
    async def _acknowledged(reader: asyncio.Task[None], mine: Attachment) -> bool:
        """The final output went out: did the gateway get it through to its
        client? It acknowledges with a `cancel` once its client has the last
        event. Anything else -- the call broke (the gateway died or was cut
        off while relaying the last deltas: it may lag the engine by many;
        a keepalive failure does not always mark the call cancelled), no
        acknowledgement in time -- keeps the finished generation for a
        resume, as a running one would be: unneeded, it costs a record for
        the grace, never KV."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_ACK_WAIT_SECONDS):
                await asyncio.shield(reader)
        return mine.polite

    async def _replay(self, generation: Generation, context: grpc.aio.ServicerContext,
                      resumed: engine_pb2.EngineResumed) -> bool:
        """Send `resumed` and every output taken so far; True if that ended the stream."""
        await context.write(engine_pb2.EngineGenerateEvent(resumed=resumed))
        for out in list(generation.record.deltas):
            await context.write(_delta(out))
        final = generation.record.final
        if final is None:
            return False
        if generation.handed_over:
            await context.abort(grpc.StatusCode.UNAVAILABLE, final.message)
        await context.write(_finished(final))
        return True

    async def _stream(self, generation: Generation, context: grpc.aio.ServicerContext,
                      span: Span = NO_SPAN) -> None:
        outputs = generation.outputs(close=False)
        # Traced: the same outputs, with first-token and end events (none when off).
        stream = outputs if span is NO_SPAN else generate_trace.traced(outputs, span)
        try:
            async for out in stream:
                if out.token_ids or out.text or out.logprobs:
                    await context.write(_delta(out))
                if out.finish_reason is not None:
                    if generation.handed_over:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, out.message)
                    await context.write(_finished(out))
                    return
        except InvalidRequest as exc:  # the backend refused it before any output
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this request failed (any cause); the engine lives on
            await context.write(_finished(GenerationOutput(
                token_ids=[], text="", finish_reason=FinishReason.ERROR, message=f"engine error: {exc}")))
        finally:
            if stream is not outputs:
                await stream.aclose()  # type: ignore[attr-defined]  # an async generator
            await outputs.aclose()

    @staticmethod
    async def _read_cancel(context: grpc.aio.ServicerContext, generation: Generation, mine: Attachment) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    return  # half-close OR a cancel in disguise: never ends the generation
                if msg.WhichOneof("msg") == "cancel":
                    mine.polite = True
                    generation.cancel("cancelled by the client")
                    return

    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return engine_pb2.AbortResponse(found=await self._runtime.abort(request.request_id))

    async def GetInfo(self, request: engine_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.EngineInfo:
        info = self._runtime.backend.info
        load = self._runtime.load()
        return engine_pb2.EngineInfo(
            engine_id=self._engine_id, model=info.model, backend=self._backend_name,
            block_size=info.block_size, total_blocks=info.total_blocks, max_running=info.max_running,
            max_model_len=info.max_model_len, running=load.running, waiting=load.waiting,
            blocks_used=load.blocks_used, cached_blocks=load.cached_blocks,
            serving=self._runtime.serving,
        )
