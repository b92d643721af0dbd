"""The scheduler's side of engines' Connect streams (`Scheduler.Connect`):
hello -> registration (core event `EngineJoined`), load reports, KV events
(alone, or inside a load report: applied before it) and snapshots -> core
events, the core's commands and `Fence`s back.

Each stream has a command mailbox and one writer task; a reader task feeds
the engine's messages to the core. A registration ends with its stream --
or at once when a newer process of the same engine id says hello
(engine_registry.py: incarnations): the old stream is then ended
FAILED_PRECONDITION with trailing metadata `kvmesh-superseded-by` (the
newer process's address), the same answer an older process's hello gets, so
the engine recognises it and stops (services/engine/scheduler_link.py)
instead of reconnecting. Every hello is first checked against the
incarnations recorded beyond this process (incarnation_store.py), so the
fence holds across a scheduler restart and across replicas. Each load
report is checked against the lease table and what an engine runs without
a lease there is sent back in a `Fence` command (fencing.py).

Concurrency: everything runs on the servicer's one event loop, and the core
is called only synchronously from it (see core.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import grpc

from services.common.clock import Clock
from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.common.scheduler_replica import KV_IN_REPORTS_METADATA_KEY, REPLICA_METADATA_KEY

from . import events as ev
from .core import SchedulerCore
from .engine_registry import DuplicateEngineError, EngineInfo, EngineLoad, SupersededEngineError, superseded_error
from .fencing import FenceBook
from .incarnation_store import IncarnationStore, MemoryIncarnations

__all__ = ["SUPERSEDED_METADATA_KEY", "EngineLinks", "ProtocolError", "hello_info"]

log = logging.getLogger(__name__)

# Trailing metadata of a Connect ended because a newer process of the engine's
# id registered: the newer process's address.
SUPERSEDED_METADATA_KEY = "kvmesh-superseded-by"

_ConnectContext: TypeAlias = (
    "grpc.aio.ServicerContext[scheduler_pb2.EngineMessage, scheduler_pb2.SchedulerCommand]"
)


class ProtocolError(Exception):
    """A peer broke the stream protocol; the message says what to change."""


def hello_info(hello: scheduler_pb2.EngineHello, hash_block_tokens: int) -> EngineInfo:
    problems = []
    if not hello.engine_id:
        problems.append("engine_id is empty")
    if not hello.address:
        problems.append("address is empty")
    if not hello.model:
        problems.append("model is empty")
    if hello.block_size <= 0 or hello.block_size % hash_block_tokens:
        problems.append(
            f"block_size {hello.block_size} must be a positive multiple of the mesh's "
            f"hash_block_tokens {hash_block_tokens}")
    if hello.total_blocks <= 0:
        problems.append("total_blocks must be > 0")
    if hello.max_running <= 0:
        problems.append("max_running must be > 0")
    if hello.weight < 0:
        problems.append("weight must be >= 0 (0 means 1)")
    if hello.hash_block_tokens not in (0, hash_block_tokens):
        problems.append(
            f"hash_block_tokens {hello.hash_block_tokens} differs from the mesh's "
            f"{hash_block_tokens}; KV hashes would not match")
    if problems:
        raise ProtocolError("invalid hello: " + "; ".join(problems))
    # The address is kept as sent (host:port, the host a DNS name or an IP):
    # gateways dial it and gRPC resolves names, so nothing here parses it.
    return EngineInfo(
        engine_id=hello.engine_id, address=hello.address, model=hello.model,
        block_size=hello.block_size, total_blocks=hello.total_blocks,
        max_running=hello.max_running, weight=hello.weight or 1.0,
        max_model_len=hello.max_model_len, backend=hello.backend, http_address=hello.http_address,
        incarnation=hello.incarnation, model_revision=hello.model_revision,
        scheduler_replicas=max(1, hello.scheduler_replicas),
    )


def _load(report: scheduler_pb2.LoadReport, unleased: int = 0) -> EngineLoad:
    return EngineLoad(
        running=report.running, waiting=report.waiting, blocks_used=report.blocks_used,
        blocks_total=report.blocks_total, cached_blocks=report.cached_blocks,
        serving=report.serving, queued_tokens=report.queued_tokens,
        request_ids=frozenset(report.request_ids),
        prefix_cache_queries=report.prefix_cache_queries, prefix_cache_hits=report.prefix_cache_hits,
        prefill_tokens_per_second=report.prefill_tokens_per_second, step_seconds=report.step_seconds,
        step_token_budget=report.step_token_budget, other_leases=report.other_replica_generations,
        unleased=unleased, backend_progress=report.backend_progress,
    )


async def _read(context: _ConnectContext) -> scheduler_pb2.EngineMessage | None:
    """The engine's next message, or None at the end of its stream."""
    msg: object = await context.read()
    return None if msg is grpc.aio.EOF else cast(scheduler_pb2.EngineMessage, msg)


def _retrieve(task: asyncio.Task[None]) -> None:
    """A reader's error is the stream ending (a broken read is the engine leaving)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("engine stream read ended: %r", task.exception())


@dataclass
class _EngineChannel:
    token: int
    commands: asyncio.Queue[scheduler_pb2.SchedulerCommand]
    # Set to the newer process's address when one superseded this stream's.
    superseded_by: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class EngineLinks:
    def __init__(
        self, core: SchedulerCore, config: MeshConfig, clock: Clock,
        deliver: Callable[[ev.Outbox], None], incarnations: IncarnationStore | None = None,
        replica: str = "",
    ) -> None:
        self._core = core
        # Sent to each engine at registration: it takes this replica's fences
        # only for generations this replica leased (scheduler_replica.py).
        self._replica = replica
        # The greatest incarnation per id beyond this process (incarnation_store.py).
        self._incarnations: IncarnationStore = incarnations or MemoryIncarnations()
        self._clock = clock
        self._deliver = deliver
        self._hash_block_tokens = config.hash_block_tokens
        # Generations engines run without a lease here (fencing.py).
        self.fences = FenceBook(config.fencing, clock.monotonic())
        self.channels: dict[str, _EngineChannel] = {}

    def command(self, engine_id: str, command: scheduler_pb2.SchedulerCommand) -> None:
        channel = self.channels.get(engine_id)
        if channel is not None:
            channel.commands.put_nowait(command)

    async def connect(self, context: _ConnectContext) -> None:
        first = await _read(context)
        if first is None:
            return
        if first.WhichOneof("msg") != "hello":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the first Connect message must be `hello` (EngineHello)")
        try:
            info = hello_info(first.hello, self._hash_block_tokens)
        except ProtocolError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        joined = await self._join(info, context)
        metadata = [(KV_IN_REPORTS_METADATA_KEY, "1")]   # LoadReport.kv_events are read here
        if self._replica:
            metadata.append((REPLICA_METADATA_KEY, self._replica))
        await context.send_initial_metadata(tuple(metadata))
        channel = _EngineChannel(joined.token, asyncio.Queue())
        self._take_over(info, channel, joined.superseded)
        writer = asyncio.create_task(self._write_commands(context, channel))
        reader = asyncio.create_task(self._read_messages(info.engine_id, channel, context))
        reader.add_done_callback(_retrieve)
        log.info("engine %s connected (%s, model %s, incarnation %d)", info.engine_id, info.address,
                 info.model, info.incarnation)
        try:
            self._deliver(joined)
            pending: set[asyncio.Future[Any]] = {reader, channel.superseded_by}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if channel.superseded_by.done():
                newer = channel.superseded_by.result()
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"engine id {info.engine_id!r}: a newer process of this engine registered from "
                    f"{newer}; this one ({info.address}, incarnation {info.incarnation}) must stop",
                    ((SUPERSEDED_METADATA_KEY, newer),))
        finally:
            reader.cancel()
            writer.cancel()
            if self.channels.get(info.engine_id) is channel:
                del self.channels[info.engine_id]
                self.fences.left(info.engine_id)
            self._deliver(self._core.handle(ev.EngineLeft(info.engine_id, joined.token)))
            log.info("engine %s disconnected (%s)", info.engine_id, info.address)

    async def _join(self, info: EngineInfo, context: _ConnectContext) -> ev.Outbox:
        """The core's answer to the hello; a refused hello ends the stream.
        The shared record of incarnations is asked first: it remembers what
        this scheduler forgot in a restart, or never saw (another replica)."""
        try:
            newest = await self._incarnations.remember(info.engine_id, info.incarnation, info.address)
            if info.incarnation and newest.incarnation > info.incarnation:
                raise superseded_error(info, newest.incarnation, newest.address)
            return self._core.handle(ev.EngineJoined(info))
        except SupersededEngineError as err:
            log.error("refused a Connect: %s", err)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err),
                                ((SUPERSEDED_METADATA_KEY, err.newer_address),))
        except DuplicateEngineError as err:
            log.warning("refused a Connect: %s", err)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    def _take_over(self, info: EngineInfo, channel: _EngineChannel, old: ev.Superseded | None) -> None:
        """Make `channel` the engine's; a superseded process's stream ends."""
        previous = self.channels.get(info.engine_id)
        self.channels[info.engine_id] = channel
        self.fences.joined(info.engine_id, self._clock.monotonic())
        if old is None:
            return
        self._core.metrics.superseded.inc()
        if previous is not None and not previous.superseded_by.done():
            previous.superseded_by.set_result(info.address)
        # Loud either way: a live duplicate looks exactly like this.
        log.log(logging.ERROR if old.was_fresh else logging.WARNING,
                "engine %s: a newer process (%s, incarnation %d) superseded the registered one (%s, "
                "incarnation %d%s); its %d leases end as if it was lost and it is fenced out. If this is "
                "not a restart of that engine, two engines share the id %r", info.engine_id, info.address,
                info.incarnation, old.address, old.incarnation,
                ", still reporting" if old.was_fresh else ", silent", old.leases, info.engine_id)

    async def _read_messages(self, engine_id: str, channel: _EngineChannel, context: _ConnectContext) -> None:
        while True:
            msg = await _read(context)
            if msg is None:
                return
            self._on_message(engine_id, channel, msg)

    def _on_message(self, engine_id: str, channel: _EngineChannel, msg: scheduler_pb2.EngineMessage) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "load":
            for kv in msg.load.kv_events:   # what the engine's cache did before this report
                self._kv_events(engine_id, channel, kv, in_report=True)
            load = _load(msg.load, self._unleased(engine_id, msg.load))
            placed = [p.prefix_hashes for p in msg.load.placed_elsewhere]
            self._deliver(self._core.handle(ev.LoadReported(
                engine_id, channel.token, load, placed, with_kv=bool(msg.load.kv_events))))
            if self.channels.get(engine_id) is channel:
                self._fence(engine_id, channel, msg.load.request_ids)
        elif kind == "kv_events":
            self._kv_events(engine_id, channel, msg.kv_events)
        elif kind == "kv_snapshot":
            snap = msg.kv_snapshot
            self._deliver(self._core.handle(ev.KvSnapshotReported(
                engine_id, channel.token, snap.seq, snap.hashes)))
        elif kind == "hello":
            log.warning("engine %s sent a second hello on one stream; ignored", engine_id)

    def _kv_events(self, engine_id: str, channel: _EngineChannel, kv: scheduler_pb2.KvEvents,
                   in_report: bool = False) -> None:
        self._deliver(self._core.handle(ev.KvEventsReported(
            engine_id, channel.token, kv.seq, kv.stored, kv.removed, kv.cleared, in_report)))

    def _unleased(self, engine_id: str, report: scheduler_pb2.LoadReport) -> int:
        """Of an engine reporting to several replicas, the generations it
        lists that this replica does not lease there: a dead replica's until
        their leases re-attach here take its slots too. One scheduler: 0
        (its reports are read as they always were)."""
        record = self._core.fleet.get(engine_id)
        if record is None or record.info.scheduler_replicas <= 1:
            return 0
        holder = self._core.lease_holder
        return sum(1 for r in report.request_ids if holder(r) != engine_id)

    def _fence(self, engine_id: str, channel: _EngineChannel, reported: Sequence[str]) -> None:
        """Tell the engine to end what it runs without a lease here."""
        fenced = self.fences.check(engine_id, reported, self._core.lease_holder, self._clock.monotonic())
        if fenced:
            self._core.metrics.fenced.labels(engine_id).inc(len(fenced))
            log.warning("engine %s runs %d generations not leased to it (%s); fencing them",
                        engine_id, len(fenced), ", ".join(fenced[:5]) + (" ..." if len(fenced) > 5 else ""))
            channel.commands.put_nowait(
                scheduler_pb2.SchedulerCommand(fence=scheduler_pb2.Fence(request_ids=fenced)))

    @staticmethod
    async def _write_commands(context: _ConnectContext, channel: _EngineChannel) -> None:
        try:
            while True:
                await context.write(await channel.commands.get())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream is gone; the reader ends it
            log.debug("engine command stream ended: %r", exc)


