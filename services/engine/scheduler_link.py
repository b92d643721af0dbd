"""The engine's Connect stream to the scheduler (engine side).

The protocol (`Scheduler.Connect` in protos/kvmesh/v1/scheduler.proto; the
engine's membership lives exactly as long as this stream): `hello`, then a
`kv_snapshot` (seq S), then `load` every report_interval_seconds and promptly
after a change (at most one per `min_report_gap`), and `kv_events` with seq
S+1, S+2, ... as the prefix cache changes. `resync` from the scheduler -> a fresh `kv_snapshot`; `drain` ->
the engine refuses new generations and finishes the running ones (with
`hand_over`: hands them over now), `undrain` -> it takes new ones again; `fence` ->
the named generations, which the scheduler leases to no request here, end
(fencing.py). Every load report lists the generations held, so after a
healed partition the engine re-registers and its orphans are fenced. When the
stream breaks (scheduler restart, network), the link reconnects with
exponential backoff capped at 2 s and sends hello + snapshot again.

Several scheduler replicas (README "Several schedulers"): one link per
replica, all fed the same events by `scheduler_links.SchedulerLinks`, and
sharing the process's incarnation and its `Fencer`. Each learns its
replica's name from the stream's initial metadata (scheduler_replica.py),
lists in its reports only that replica's generations (fencing.py) and takes
fences from it for those only. With several replicas a generation that
starts or ends is reported at once (`notify_now`: at the writer's next turn,
so what starts in one loop turn goes out in one report), not after
`min_report_gap`: the other replicas learn of each other's placements about
a millisecond after the engine does, and do not fill its slots twice. The
same report tells each replica the prompts the OTHER replicas placed here
(`placed_elsewhere`, as prefix hashes), so its in-flight prefixes and live
working set count them as its own placements.

Identity: the hello carries the engine id and this process's incarnation
(`new_incarnation`, chosen once per engine process, shared by its links: unix ms
<< 22 | 22 random bits, so a later start compares greater). A restarted or
rescheduled engine -- same id, maybe a new address -- supersedes its old
registration at once (services/scheduler/engine_registry.py). The process it
superseded is told so: its stream ends (or its next hello is refused)
FAILED_PRECONDITION with trailing metadata `kvmesh-superseded-by`; it then
fails as a whole (`runtime.fail`: every generation handed over, the
gateways migrate them; the process exits for its supervisor) instead of
reconnecting -- an old process cut off by a partition cannot come back over
the new one. The address announced is the server's (`EngineService.address`:
`engine.advertise_address` when set -- the host may be a DNS name, which
gateways resolve -- else the bound one).

KV events are batched so that no hash is both stored and removed in one
message (the batch is cut instead), so the scheduler may apply a message's
lists in any order. A scheduler that says so (initial metadata
`kvmesh-kv-in-reports`) gets them inside the next load report
(LoadReport.kv_events, due at most `min_report_gap` later) instead of as
messages of their own: a generation's start stores blocks and changes the
load at once, and one message costs the scheduler ~100 us of gRPC whatever
it carries (BENCHMARKS.md "Third pass"). Its in-flight prefixes cover its
own placements meanwhile. If too many pile up while the scheduler is slow, they
are dropped and a snapshot is sent in their place: memory stays bounded.

Ownership: one task per link owns the stream; listeners only append to the
event log and set an event, synchronously, on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TypeAlias, cast

import grpc

from services.common.config import ConfigError, EngineConfig, MeshConfig
from services.common.grpc_server import client_options
from services.common.mesh_tls import aio_channel, identity_for
from services.common.model_revision import model_revision
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.scheduler_replica import KV_IN_REPORTS_METADATA_KEY, REPLICA_METADATA_KEY
from services.engine.fencing import Fencer, fenceable
from services.engine.kv_event_log import KvEventLog
from services.engine.model import resolve_model
from services.engine.runtime import EngineRuntime

__all__ = ["SUPERSEDED_METADATA_KEY", "KvEventLog", "LinkOptions", "SchedulerLink", "advertised_host",
           "new_incarnation"]

log = logging.getLogger(__name__)

BACKOFF_INITIAL_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 2.0

# Trailing metadata of a Connect the scheduler ended because a newer process
# of this engine id registered (services/scheduler/engine_links.py).
SUPERSEDED_METADATA_KEY = "kvmesh-superseded-by"
_INCARNATION_RANDOM_BITS = 22
# Prompts other replicas placed here, kept for one replica's next report at
# most: reports go out at once after each start, so more pile up only while
# the link is down, and then they are old news.
_PLACED_ELSEWHERE_MAX = 64

# The engine's side of Scheduler.Connect (a string: grpc.aio's call classes are
# generic only in the type stubs).
_ConnectCall: TypeAlias = (
    "grpc.aio.StreamStreamCall[scheduler_pb2.EngineMessage, scheduler_pb2.SchedulerCommand]"
)


def new_incarnation() -> int:
    """This process's incarnation (EngineHello.incarnation): greater for a
    later start (wall-clock milliseconds, so across hosts too, given clocks
    agree to well within a restart), random low bits for two starts in one
    millisecond; fits in 63 bits."""
    return (time.time_ns() // 1_000_000) << _INCARNATION_RANDOM_BITS | secrets.randbits(_INCARNATION_RANDOM_BITS)


def superseded_by(exc: BaseException) -> str | None:
    """The newer process's address if `exc` ended this link because a newer
    process of the engine's id registered; else None."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == SUPERSEDED_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def advertised_host(host: str) -> str:
    """The host others dial: a wildcard bind advertises this machine's address."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


@dataclass
class LinkOptions:
    """What one link of several shares or differs in (scheduler_links.py)."""

    scheduler_address: str = ""    # "" = engine.scheduler_address
    incarnation: int = 0           # the process's (0 = choose one)
    fencer: Fencer | None = None   # the process's (None = its own)
    prompt: bool = False           # report starts and ends at once (several replicas)


class SchedulerLink:
    def __init__(
        self,
        config: MeshConfig,
        engine: EngineConfig,
        runtime: EngineRuntime,
        address: str,
        http_address: str = "",
        backend_name: str = "",
        options: LinkOptions | None = None,
    ) -> None:
        options = options or LinkOptions()
        self._config = config
        self._engine = engine
        self._runtime = runtime
        self._address = address  # the server's `address`: advertise_address when set
        # The replica this link dials, and its name once it answered ("" before).
        self.scheduler_address = options.scheduler_address or engine.scheduler_address
        self.replica = ""
        self._prompt = options.prompt
        self.incarnation = options.incarnation or new_incarnation()
        self._revision: str | None = None   # EngineHello.model_revision, on first hello
        self.superseded_by: str | None = None  # set once a newer process took the id over
        self._http_address = http_address
        self._backend_name = backend_name or engine.backend
        self._identity = identity_for(config, "engine")
        self.fencer = options.fencer or Fencer(runtime, engine.engine_id, config.fencing)
        self._interval = engine.report_interval_seconds
        self.min_report_gap = max(0.005, self._interval / 4)
        # A report equal to the last one sent is news to nobody: it is left
        # out, but one goes out at least every `heartbeat` so the engine
        # stays fresh (a quarter of scheduler.stale_report_seconds: 0.5 s by
        # default). An engine decoding with nothing placed or finished repeats
        # itself every 0.1 s, and each message costs the scheduler ~5
        # wake-ups (grpc's event_engine thread + its loop; BENCHMARKS.md
        # "Path cost per request" has the counts before and after).
        self.heartbeat = max(self._interval, config.scheduler.stale_report_seconds / 4)
        self._last_report = b""
        self._last_report_at = 0.0
        self.reports_skipped = 0
        self._wake = asyncio.Event()
        self.events = KvEventLog(self._wake)
        self._changed = False
        self._urgent = False  # a generation started or ended: report at once (`_prompt`)
        self._sent_serving: bool | None = None  # `serving` in the last report sent
        # Prefix hashes of prompts other replicas placed here, for this one's next report.
        self._placed_elsewhere: deque[list[int]] = deque(maxlen=_PLACED_ELSEWHERE_MAX)
        self._kv_in_reports = False  # the scheduler reads KV events inside load reports (this session)
        self._resync = False
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()  # set while a session is up (tests, status)
        self.sessions = 0

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Run the link (`SchedulerLinks` feeds it the engine's events)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="scheduler-link")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def kv_in_reports(self) -> bool:
        """This session's scheduler reads KV events inside load reports."""
        return self._kv_in_reports

    def notify(self) -> None:
        """Load changed: report promptly (rate-limited)."""
        self._changed = True
        self._wake.set()

    def notify_now(self) -> None:
        """A generation started or ended: with several replicas, report at
        the writer's next turn; else as `notify`."""
        self._urgent = self._prompt
        self.notify()

    def placed_elsewhere(self, owner: str, prefix_hashes: list[int]) -> None:
        """A generation replica `owner` leased started here: unless that is
        this link's replica, tell it at its next report (LoadReport.placed_elsewhere)."""
        if self.replica and owner != self.replica:
            self._placed_elsewhere.append(prefix_hashes)

    # ---------------------------------------------------------------- sessions

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = BACKOFF_INITIAL_SECONDS
        failures = 0
        while True:
            began = loop.time()
            try:
                await self._session()
                reason = "the scheduler ended the stream"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any break means reconnect
                reason = _describe(exc)
                if self._superseded(exc):
                    return
            finally:
                self.connected.clear()
            if loop.time() - began > BACKOFF_MAX_SECONDS:
                backoff, failures = BACKOFF_INITIAL_SECONDS, 0
            failures += 1
            # The first failure, then a reminder about every 30 s (at the 2 s
            # cap): an outage, or a refusal such as a duplicate engine id, must
            # stay visible without a line every retry.
            level = logging.WARNING if failures % 15 == 1 else logging.DEBUG
            log.log(level, "scheduler link to %s down (%s); retrying in %.2fs",
                    self.scheduler_address, reason, backoff)
            await asyncio.sleep(backoff)
            backoff = min(BACKOFF_MAX_SECONDS, backoff * 2)

    def _superseded(self, exc: BaseException) -> bool:
        """A newer process of this engine id took over: stop for good."""
        newer = superseded_by(exc)
        if newer is None:
            return False
        self.superseded_by = newer
        log.error("engine %s (%s, incarnation %d) was superseded by a newer process of the same id at %s; "
                  "stopping (if that is not a restart of this engine, two engines share the id: %s)",
                  self._engine.engine_id, self._address, self.incarnation, newer, _describe(exc))
        self._runtime.fail(f"superseded by a newer process of engine {self._engine.engine_id!r} at {newer}")
        return True

    async def _session(self) -> None:
        options = [*client_options(),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX_SECONDS * 1000))]
        async with aio_channel(self.scheduler_address, self._identity, "scheduler", options) as channel:
            call = scheduler_pb2_grpc.SchedulerStub(channel).Connect()
            try:
                await call.write(scheduler_pb2.EngineMessage(hello=self._hello()))
                await self._send_snapshot(call)
                self.sessions += 1
                self.connected.set()
                log.info("registered with the scheduler at %s", self.scheduler_address)
                reader = asyncio.create_task(self._read(call))
                writer = asyncio.create_task(self._write(call))
                try:
                    await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    # Also when stop() cancels us mid-wait: no task may outlive
                    # the session or leave its error unretrieved.
                    for task in (reader, writer):
                        task.cancel()
                        task.add_done_callback(_retrieve)
                results = await asyncio.gather(reader, writer, return_exceptions=True)
                errors = [r for r in results if isinstance(r, Exception)]
                if errors:
                    raise errors[0]  # the error that ended the session
            finally:
                call.cancel()
                self.fencer.replica_down(self.replica)
                self.replica = ""
                self._kv_in_reports = False

    def _hello(self) -> scheduler_pb2.EngineHello:
        info = self._runtime.backend.info
        return scheduler_pb2.EngineHello(
            engine_id=self._engine.engine_id, address=self._address, model=info.model,
            block_size=info.block_size, total_blocks=info.total_blocks,
            max_running=info.max_running, weight=self._engine.weight,
            max_model_len=info.max_model_len, hash_block_tokens=self._config.hash_block_tokens,
            backend=self._backend_name, http_address=self._http_address,
            incarnation=self.incarnation, model_revision=self._model_revision(),
            scheduler_replicas=len(self._engine.schedulers()),
        )

    def _model_revision(self) -> str:
        """The served model's revision, computed once (a few MiB read)."""
        if self._revision is None:
            try:
                spec = resolve_model(self._config, self._engine)
            except ConfigError:
                self._revision = ""   # a model-less sim: nothing to fingerprint
                return self._revision
            configured = next((m.revision for m in self._config.models if m.name == spec.name), "")
            self._revision = model_revision(spec.path, configured) if spec.path is not None else configured
        return self._revision

    async def _send_snapshot(self, call: _ConnectCall) -> None:
        # Synchronous from here to the message's creation: no event can slip
        # between the snapshot and the log reset.
        hashes = self._runtime.kv_snapshot()
        self.events.reset()
        self._resync = False
        snapshot = scheduler_pb2.KvSnapshot(seq=self._seq, hashes=hashes)
        await call.write(scheduler_pb2.EngineMessage(kv_snapshot=snapshot))

    async def _read(self, call: _ConnectCall) -> None:
        for key, value in await call.initial_metadata() or ():
            if key == REPLICA_METADATA_KEY:
                self.replica = value if isinstance(value, str) else value.decode(errors="replace")
                self.fencer.replica_up(self.replica)
                self._wake.set()  # its next report lists only its own generations
            elif key == KV_IN_REPORTS_METADATA_KEY:
                self._kv_in_reports = True
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                return
            # grpc.aio types read() as object (EOF or the response).
            command = cast(scheduler_pb2.SchedulerCommand, message)
            kind = command.WhichOneof("cmd")
            if kind == "drain":
                self._runtime.drain(command.drain.hand_over)
            elif kind == "undrain":
                self._runtime.undrain()
            elif kind == "resync":
                self._resync = True
                self._wake.set()
            elif kind == "fence":
                self.fencer.apply(command.fence.request_ids, self.replica)

    async def _write(self, call: _ConnectCall) -> None:
        loop = asyncio.get_running_loop()
        self._last_report = b""  # a new session's first report always goes out
        await self._send_load(call)
        last_load = loop.time()
        while True:
            # Clear first: anything that happens during the writes below sets
            # the event again and is seen on the next turn.
            self._wake.clear()
            if self._resync or self.events.overflowed:
                await self._send_snapshot(call)
            if self._kv_in_reports:
                self._changed = self._changed or bool(self.events)   # they go in the next report
            else:
                for events in self._take_events():
                    await call.write(scheduler_pb2.EngineMessage(kv_events=events))
            now = loop.time()
            due = last_load + (0.0 if self._urgent else self.min_report_gap if self._changed else self._interval)
            # A change of `serving` goes out at once: a failed engine must
            # stop getting placements before its streams' replacements ask.
            if now >= due or self._runtime.serving != self._sent_serving:
                await self._send_load(call)
                last_load = loop.time()
                continue
            if self._wake.is_set():
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=due - now)

    def _take_events(self) -> list[scheduler_pb2.KvEvents]:
        """The KV events waiting, numbered on (KvEvents.seq)."""
        taken = self.events.take()
        for events in taken:
            self._seq += 1
            events.seq = self._seq
        return taken

    async def _send_load(self, call: _ConnectCall) -> None:
        self._changed = self._urgent = False
        load = self._runtime.load()
        # Not the engine's own endpoint's (fencing.py); only this replica's.
        listed, others = self.fencer.listed_to(fenceable(load.request_ids), self.replica)
        placed = [scheduler_pb2.PlacedPrompt(prefix_hashes=h) for h in self._placed_elsewhere]
        self._placed_elsewhere.clear()
        report = scheduler_pb2.LoadReport(
            running=load.running, waiting=load.waiting, blocks_used=load.blocks_used,
            blocks_total=load.blocks_total, cached_blocks=load.cached_blocks,
            serving=self._runtime.serving, queued_tokens=load.queued_tokens,
            request_ids=listed, other_replica_generations=others,
            prefill_tokens_per_second=load.prefill_tokens_per_second,
            step_seconds=load.step_seconds, step_token_budget=load.step_token_budget,
            placed_elsewhere=placed,
        )
        report.prefix_cache_queries, report.prefix_cache_hits = self._runtime.metrics.prefix_cache_totals()
        self._sent_serving = report.serving
        blob = report.SerializeToString(deterministic=True)
        now = asyncio.get_running_loop().time()
        kv = self._take_events() if self._kv_in_reports else []
        if not placed and not kv and blob == self._last_report and now - self._last_report_at < self.heartbeat:
            self.reports_skipped += 1
            return
        self._last_report, self._last_report_at = blob, now
        # After the blob: a repeat of the same load is still left out.
        report.kv_events.extend(kv)
        report.backend_progress = self._runtime.liveness.progress
        await call.write(scheduler_pb2.EngineMessage(load=report))


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a session task's outcome as seen (its error is raised, or moot)."""
    if not task.cancelled():
        task.exception()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
