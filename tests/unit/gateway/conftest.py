"""In-process fakes for the gateway's peers, and a gateway wired to them.

- `FakeScheduler`: answers Admit with `queued` (optionally several, or held
  until released), then `placed` on the first engine not excluded; answers
  `replace` with another placement; can reject with any code. Preemption:
  `preempt(record)` sends `Preempted` on a request's stream (or at once on
  its `first_token` / `done`); a `requeue` is answered like a queued request
  (queued updates, held until released, then placed on the next engine of
  `requeue_engines`, or rejected).
- `FakeEngine`: streams deterministic tokens where each token is a pure
  function of ALL tokens before it (like the sim), so a migrated stream can
  be compared token for token; can break after N tokens, or pause after N
  tokens (one call, until cancelled); records its requests and cancels.
- A tokenizer: the real `.models/tiny-llama` one if it exists, else a tiny
  `tokenizers` WordLevel model with a jinja chat template built in a tmp dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import grpc
import pytest

from services.common.config import ApiKeyConfig, GatewayConfig, MeshConfig, ModelConfig
from services.common.proto.kvmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common.stop_text import StopText
from services.engine.generate_many import GenerateManyCall

if TYPE_CHECKING:
    from services.gateway.server import GatewayService

ROOT = Path(__file__).resolve().parents[3]
REAL_TOKENIZER = ROOT / ".models" / "tiny-llama"
MODEL = "tiny"

KEY_FULL = "sk-full"          # ceiling P0, every model
KEY_P1 = "sk-p1"              # ceiling P1
KEY_SLOW = "sk-slow"          # 1 request/s
KEY_OTHER = "sk-other"        # may use only "other-model"
KEY_SHORT = "sk-short"        # generations capped at 0.3 s


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ------------------------------------------------------------------ tokenizer


def _build_tiny_model(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant",
             "hello", "world", "the", "capital", "of", "france", "is", "what", "say", "hi", "a", "b", "c"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None})
    )
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    return directory


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (REAL_TOKENIZER / "tokenizer.json").is_file() and (REAL_TOKENIZER / "config.json").is_file():
        return REAL_TOKENIZER
    return _build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# ------------------------------------------------------------------ fake engine


def next_token(tokens: list[int]) -> int:
    """The fake model: a pure function of every token before it."""
    acc = 7
    for t in tokens[-32:]:
        acc = (acc * 31 + t) % 100_003
    return 10 + (acc + len(tokens)) % 900


def token_text(token: int) -> str:
    return f" w{token}"


def expected_answer(prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    tokens = list(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
    return out, "".join(token_text(t) for t in out)


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine_id: str, *, answer_tokens: int = 6, token_delay: float = 0.0,
                 break_after: int | None = None, cached_tokens: int = 0) -> None:
        self.engine_id = engine_id
        self.answer_tokens = answer_tokens   # the "model" emits EOS after this many tokens in total
        self.token_delay = token_delay
        self.break_after = break_after       # abort with UNAVAILABLE after this many tokens of one call
        self.cached_tokens = cached_tokens
        # Once: the next call stops producing after this many tokens and
        # waits until cancelled (sets `paused`).
        self.pause_after: int | None = None
        self.paused = asyncio.Event()
        self.cancels = 0
        self.requests: list[engine_pb2.EngineRequest] = []
        self.cancelled = asyncio.Event()
        # `cancel` messages received (a call that just ends leaves a real
        # engine's generation kept for a resume: services/engine/detached.py).
        self.polite_cancels = 0
        self.cancelled_at: float | None = None
        self.address = ""
        self.server: grpc.aio.Server | None = None

    async def Generate(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - the proto's method name
        first = await context.read()
        request = first.request
        self.requests.append(request)
        stop = asyncio.Event()

        async def watch_cancel() -> None:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                if message.HasField("cancel"):
                    self.polite_cancels += 1
                    stop.set()
                    return

        watcher = asyncio.create_task(watch_cancel())
        tokens = list(request.prompt_token_ids)
        total = request.resumed_tokens
        produced = 0
        reason = common_pb2.FINISH_REASON_STOP
        pause_after, self.pause_after = self.pause_after, None
        # Stop strings as vLLM applies them, holding back a possible start.
        stop_text = StopText(list(request.sampling.stop))
        try:
            while True:
                if stop.is_set():
                    self._mark_cancelled()
                    return
                if total >= self.answer_tokens:
                    break
                if produced >= request.sampling.max_tokens:
                    reason = common_pb2.FINISH_REASON_LENGTH
                    break
                if self.break_after is not None and produced >= self.break_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine broke")
                if pause_after is not None and produced >= pause_after:
                    self.paused.set()
                    await stop.wait()
                    continue
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                t = next_token(tokens)
                tokens.append(t)
                produced += 1
                total += 1
                lp = []
                if request.sampling.HasField("logprobs"):
                    lp = [common_pb2.TokenLogprob(token_id=t, token=token_text(t), logprob=-0.5,
                                                  top=[common_pb2.TopLogprob(token_id=t, token=token_text(t),
                                                                             logprob=-0.5)])]
                text, stopped = stop_text.add(token_text(t))
                await context.write(engine_pb2.EngineGenerateEvent(delta=engine_pb2.EngineDelta(
                    token_ids=[t], text=text, logprobs=lp, held_text=stop_text.held)))
                if stopped:
                    break
            if stop_text.held:
                await context.write(engine_pb2.EngineGenerateEvent(
                    delta=engine_pb2.EngineDelta(text=stop_text.flush())))
            prompt = len(request.prompt_token_ids) - request.resumed_tokens
            await context.write(engine_pb2.EngineGenerateEvent(finished=engine_pb2.EngineFinished(
                finish_reason=reason,
                usage=common_pb2.Usage(prompt_tokens=prompt, completion_tokens=total,
                                       cached_tokens=self.cached_tokens))))
        except asyncio.CancelledError:
            self._mark_cancelled()
            raise
        finally:
            watcher.cancel()

    async def GenerateMany(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - the proto's method name
        """Generate streams over one call, as a real engine serves them."""
        await GenerateManyCall(self.Generate, context).serve()

    def _mark_cancelled(self) -> None:
        self.cancels += 1
        if self.cancelled_at is None:
            self.cancelled_at = time.monotonic()
        self.cancelled.set()


# ------------------------------------------------------------------ fake scheduler


@dataclass
class AdmitRecord:
    request: scheduler_pb2.AdmitRequest
    messages: list[str] = field(default_factory=list)       # first_token / done / replace / requeue
    replaces: list[scheduler_pb2.Replace] = field(default_factory=list)
    requeues: list[scheduler_pb2.Requeue] = field(default_factory=list)
    context: grpc.aio.ServicerContext | None = None
    preemptions: int = 0
    done: scheduler_pb2.RequestDone | None = None
    cancelled: bool = False
    done_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_done(self, timeout: float = 10.0) -> scheduler_pb2.RequestDone:
        """The client can see its last event before this fake has read the
        gateway's `done` (two streams, no order between them): wait for it."""
        await asyncio.wait_for(self.done_seen.wait(), timeout)
        assert self.done is not None
        return self.done


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.engines: dict[str, str] = {}     # engine_id -> address, in placement order
        self.admits: list[AdmitRecord] = []
        self.reject: scheduler_pb2.Rejected | None = None
        self.queued_updates = 1
        self.queue_hold: asyncio.Event | None = None   # hold in the queue until set
        self.update_seconds = 0.05
        self.admit_cancelled = asyncio.Event()
        # Preemption: send `Preempted` at once on these messages; after a
        # `requeue`, this many queued updates (or hold until released), then
        # placed on the next of `requeue_engines` (else the first engine),
        # or `requeue_reject`.
        self.preempt_on: set[str] = set()
        self.requeue_queued = 1
        self.requeue_hold: asyncio.Event | None = None
        self.requeue_engines: list[str] = []
        self.requeue_reject: scheduler_pb2.Rejected | None = None
        # The generation limit derived from live latency, in every Placed (0 = none).
        self.generation_seconds = 0.0
        # Seconds before a Replace is placed (a restarting engine, a busy fleet).
        self.replace_delay = 0.0
        # Seconds before each read once placed: a scheduler slow to read
        # (a loaded machine), so what the gateway sends last is still unread
        # when it ends the call.
        self.read_delay = 0.0

    async def preempt(self, record: AdmitRecord, by_priority: int = 0) -> None:
        """Tell a running request its slot went to a higher class."""
        assert record.context is not None
        record.preemptions += 1
        await record.context.write(scheduler_pb2.AdmitServerMessage(preempted=scheduler_pb2.Preempted(
            engine_id="?", preemptions=record.preemptions, by_priority=by_priority)))

    async def _requeued(self, record: AdmitRecord, context: grpc.aio.ServicerContext) -> None:
        priority = record.request.priority
        for position in range(self.requeue_queued, 0, -1):
            await context.write(scheduler_pb2.AdmitServerMessage(queued=scheduler_pb2.Queued(
                position=position, priority=priority)))
        if self.requeue_hold is not None:
            await self.requeue_hold.wait()
        if self.requeue_reject is not None:
            await context.write(scheduler_pb2.AdmitServerMessage(rejected=self.requeue_reject))
            return
        engine = self.requeue_engines.pop(0) if self.requeue_engines else next(iter(self.engines))
        await context.write(scheduler_pb2.AdmitServerMessage(placed=scheduler_pb2.Placed(
            engine_id=engine, engine_address=self.engines[engine], lease_id=f"lease-{engine}-again",
            generation_seconds=self.generation_seconds)))

    def _placed(self, exclude: set[str]) -> scheduler_pb2.AdmitServerMessage:
        for engine_id, address in self.engines.items():
            if engine_id not in exclude:
                return scheduler_pb2.AdmitServerMessage(placed=scheduler_pb2.Placed(
                    engine_id=engine_id, engine_address=address, lease_id=f"lease-{engine_id}",
                    generation_seconds=self.generation_seconds))
        return scheduler_pb2.AdmitServerMessage(rejected=scheduler_pb2.Rejected(
            code=scheduler_pb2.REJECT_CODE_NO_ENGINE, message="all excluded", retry_after_seconds=1))

    async def Admit(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - the proto's method name
        first = await context.read()
        record = AdmitRecord(first.request, context=context)
        self.admits.append(record)
        requeued: list[asyncio.Task[None]] = []
        try:
            if self.reject is not None:
                await context.write(scheduler_pb2.AdmitServerMessage(rejected=self.reject))
                return
            position = 3
            await context.write(scheduler_pb2.AdmitServerMessage(queued=scheduler_pb2.Queued(
                position=position, estimated_wait_seconds=0.5, priority=record.request.priority)))
            if self.queue_hold is not None:
                while not self.queue_hold.is_set():
                    try:
                        await asyncio.wait_for(asyncio.shield(self.queue_hold.wait()), self.update_seconds)
                    except TimeoutError:
                        position = max(1, position - 1)
                        await context.write(scheduler_pb2.AdmitServerMessage(queued=scheduler_pb2.Queued(
                            position=position, estimated_wait_seconds=0.1, priority=record.request.priority)))
            for _ in range(self.queued_updates - 1):
                position = max(1, position - 1)
                await context.write(scheduler_pb2.AdmitServerMessage(queued=scheduler_pb2.Queued(
                    position=position, priority=record.request.priority)))
            await context.write(self._placed(set()))
            while True:
                if self.read_delay:
                    await asyncio.sleep(self.read_delay)
                message = await context.read()
                if message is grpc.aio.EOF:
                    # A client cancel can look like a half-close to grpc.aio
                    # (DESIGN.md): an end without `done` is a cancel.
                    if record.done is None:
                        record.cancelled = True
                        self.admit_cancelled.set()
                    return
                kind = message.WhichOneof("msg")
                record.messages.append(kind)
                if kind == "done":
                    record.done = message.done
                    record.done_seen.set()
                    if message.done.finish_reason == "abort":  # a withdrawal: the lease ends now
                        record.cancelled = True
                        self.admit_cancelled.set()
                elif kind == "replace":
                    record.replaces.append(message.replace)
                    await asyncio.sleep(self.replace_delay)
                    await context.write(self._placed(set(message.replace.exclude_engines)))
                elif kind == "requeue":
                    record.requeues.append(message.requeue)
                    # Answered aside: the stream is still read meanwhile (a `done`).
                    requeued.append(asyncio.create_task(self._requeued(record, context)))
                if kind in self.preempt_on:
                    await self.preempt(record)
        except asyncio.CancelledError:
            record.cancelled = True
            self.admit_cancelled.set()
            raise
        finally:
            for task in requeued:
                task.cancel()

    async def GetState(self, request: scheduler_pb2.GetStateRequest,  # noqa: N802 - the proto's method name
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerState:
        return scheduler_pb2.SchedulerState(engines=[
            scheduler_pb2.EngineState(engine_id=e, address=a, model=MODEL, serving=True)
            for e, a in self.engines.items()])


# ------------------------------------------------------------------ wiring


async def _serve(add: object, servicer: object) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@dataclass
class Mesh:
    scheduler: FakeScheduler
    engines: dict[str, FakeEngine]
    gateway: GatewayService
    http: str           # base URL, e.g. http://127.0.0.1:PORT
    grpc_address: str
    config: MeshConfig
    servers: list[grpc.aio.Server]
    # Every engine's GenerateMany call is up before the test uses it (else
    # a request's Generate call opens it: later requests go over it).
    many: bool = False

    async def add_engine(self, engine: FakeEngine) -> FakeEngine:
        server, address = await _serve(engine_pb2_grpc.add_EngineServicer_to_server, engine)
        engine.address, engine.server = address, server
        self.servers.append(server)
        self.engines[engine.engine_id] = engine
        self.scheduler.engines[engine.engine_id] = address
        if self.many:
            await self._call_up(address)
        return engine

    async def use_many(self) -> None:
        """From now on every engine's GenerateMany call is up before use."""
        self.many = True
        for engine in self.engines.values():
            await self._call_up(engine.address)

    async def _call_up(self, address: str) -> None:
        pool = self.gateway._engines
        assert pool is not None
        many = pool.many(address)
        async with asyncio.timeout(10):
            while not many.ready:
                await asyncio.sleep(0.005)


def make_config(model_dir: Path, scheduler_address: str, **gateway: object) -> MeshConfig:
    gw = GatewayConfig(
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        scheduler_address=scheduler_address,
        heartbeat_seconds=0.2,
        max_body_bytes=64 * 1024,
        api_keys=[
            ApiKeyConfig(sha256=sha(KEY_FULL), tenant="acme", priority_ceiling=0),
            ApiKeyConfig(sha256=sha(KEY_P1), tenant="bulk", priority_ceiling=1),
            ApiKeyConfig(sha256=sha(KEY_SLOW), tenant="slow", priority_ceiling=0, requests_per_second=1),
            ApiKeyConfig(sha256=sha(KEY_OTHER), tenant="other", models=["other-model"]),
            ApiKeyConfig(sha256=sha(KEY_SHORT), tenant="short", priority_ceiling=0, max_generation_seconds=0.3),
        ],
    )
    for name, value in gateway.items():
        setattr(gw, name, value)
    return MeshConfig(models=[ModelConfig(name=MODEL, path=str(model_dir))], gateway=gw)


@contextlib.asynccontextmanager
async def open_mesh(model_dir: Path, tune: Callable[[MeshConfig], None] | None = None,
                    **gateway: object) -> AsyncIterator[Mesh]:
    """A gateway (its config's gateway section changed by `gateway`, the
    rest by `tune`) wired to a fake scheduler and one fake engine, "engine-a"."""
    from services.gateway.server import GatewayService

    scheduler = FakeScheduler()
    sched_server, sched_address = await _serve(scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler)
    config = make_config(model_dir, sched_address, **gateway)
    if tune is not None:
        tune(config)
    service = GatewayService(config)
    try:
        http_port, grpc_port = await service.start(http_port=0, grpc_port=0)
    except BaseException:
        # e.g. a metrics port taken meanwhile: what did start must not outlive the test.
        with contextlib.suppress(Exception):
            await service.stop(grace=0)
        await sched_server.stop(0)
        raise
    m = Mesh(scheduler, {}, service, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", config,
             [sched_server])
    await m.add_engine(FakeEngine("engine-a"))
    try:
        yield m
    finally:
        await service.stop(grace=0.5)
        for server in m.servers:
            await server.stop(0)


@pytest.fixture(params=["calls", "many"])
async def mesh(model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Mesh]:
    """Each test twice: engine streams as Generate calls, and on each
    engine's GenerateMany call (services/gateway/generate_many.py)."""
    async with open_mesh(model_dir) as m:
        if request.param == "many":
            await m.use_many()
        yield m


async def leave_mid_stream(mesh: Mesh, chunks: int = 3) -> float:
    """A streamed chat whose client drops the connection after `chunks`
    content chunks; returns when (monotonic) it left. Make the engine's
    answer long first (answer_tokens, token_delay)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "stream": True,
            "max_tokens": 1000}
    async with aiohttp.ClientSession() as session:
        r = await session.post(f"{mesh.http}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY_FULL}"})
        assert r.status == 200
        seen = 0
        while seen < chunks:
            line = await r.content.readline()
            assert line, "the stream ended early"
            seen += line.startswith(b"data: {")
        left_at = time.monotonic()
        r.close()  # drop the connection mid-stream
    return left_at
