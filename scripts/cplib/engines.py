"""Synthetic engines: many engines' Connect streams from one process, each
sending what services/engine/scheduler_link.py sends -- `hello`, a
`kv_snapshot`, then a `load` report every report interval (left out when
equal to the last one, but at least every heartbeat) and promptly after a
change (at most one per interval / 4), and `kv_events` as its prefix cache
changes (inside the next load report when the scheduler says it reads them
there: initial metadata `kvmesh-kv-in-reports`) -- and obeying `resync` (a
fresh snapshot) and `fence`.

Several scheduler replicas (services/engine/scheduler_links.py): each engine
holds one Connect stream to every replica and tells each the same hello
(one incarnation, `scheduler_replicas` = how many), KV events and reports;
each link learns its replica's name from the stream's initial metadata, and
its reports list only the generations that replica leased (or of no known
replica), the others counted in `other_replica_generations`
(services/engine/fencing.py `listed_to`); a generation that starts or ends
is reported to every replica at the writer's next turn (`notify_now`), not
after the report gap; a fence ends only generations of the replica that
sent it. With one replica: one stream, reports as they always were.

A synthetic gateway tells the engine it was placed on that a request starts
or ends with one UDP datagram to the engine's announced address (where a
real gateway would open its Generate stream): "S <engine> <request> <group>
<replica> <tail hashes...>" (the replica that placed it, from
`Placed.scheduler_replica`, as the gateway's engine request carries it; "-"
for none) and "E <engine> <request>". A start stores the request's context
(evicting the least recently used ones past the cache's size) and tail in
the engine's cache and changes its load, as on a real engine.

Ownership: one event loop per host process; each engine's writer task is
the only writer of its streams; the datagram handler and the periodic sweep
only change the engine's state and wake its writer, synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import grpc

from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.scheduler_replica import KV_IN_REPORTS_METADATA_KEY, REPLICA_METADATA_KEY

from .workload import Workload, context_hashes

__all__ = ["NO_REPLICA", "EngineHostSpec", "HostCounters", "SynthEngine", "host_main", "listed_to"]

# Most unique tails an engine keeps cached before evicting the oldest.
_MAX_TAILS = 256
# The periodic sweep visits a tenth of the engines per turn: reports are
# spread over the interval as real engines' unaligned timers spread them.
_SLICES = 10
# The replica field of a start datagram when Placed named none.
NO_REPLICA = "-"


@dataclass(frozen=True)
class EngineHostSpec:
    """The engines one host process runs (first index, count)."""

    first: int
    count: int
    schedulers: tuple[str, ...]
    workload: Workload
    total_blocks: int = 4096
    max_running: int = 64
    report_interval: float = 0.1      # engines.template.report_interval_seconds
    heartbeat: float = 0.5            # scheduler.stale_report_seconds / 4 (scheduler_link.py)

    @property
    def prompt(self) -> bool:
        """Report starts and ends at once (several replicas: scheduler_links.py)."""
        return len(self.schedulers) > 1


# What a host's engines sent and obeyed, all engines summed, messages
# counted per stream (one report to 3 replicas = 3): "loads", "skipped"
# (equal reports left out), "kv_events", "kv_in_reports" (KV event batches
# carried inside load reports), "snapshots", "fenced" (request
# ids), "not_fenced" (named by a replica that did not lease them), "resyncs".
HostCounters = Counter[str]


@dataclass
class _Link:
    """One Connect stream (one replica) and what was last reported on it."""

    call: grpc.aio.StreamStreamCall
    seq: int = 0
    resync: bool = False
    replica: str = ""                 # its name (initial metadata); "" until known
    kv_in_reports: bool = False       # it reads KV events inside load reports (initial metadata)
    last_blob: bytes = b""
    last_sent_at: float = -1e9


def listed_to(owners: Mapping[str, str], request_ids: Iterable[str], replica: str,
              connected: set[str]) -> tuple[list[str], int]:
    """(the ids a report to `replica` lists, how many others it only counts),
    as services/engine/fencing.py `Fencer.listed_to`: with no replica named
    yet every id; else those `replica` leased, of no known replica, or of a
    replica not connected now."""
    ids = list(request_ids)
    if not connected:
        return ids, 0
    listed = [r for r in ids if not replica or owners.get(r, "") in ("", replica)
              or owners.get(r, "") not in connected]
    return listed, len(ids) - len(listed)


@dataclass
class SynthEngine:
    """One engine's state (its cache, its running requests) and streams."""

    engine_id: str
    spec: EngineHostSpec
    contexts: list[tuple[int, ...]]
    counters: HostCounters
    groups: OrderedDict[int, None] = field(default_factory=OrderedDict)
    tails: deque[tuple[int, ...]] = field(default_factory=deque)
    running: dict[str, tuple[int, int]] = field(default_factory=dict)   # request -> (group, blocks)
    owners: dict[str, str] = field(default_factory=dict)               # request -> replica that leased it
    events: list[scheduler_pb2.KvEvents] = field(default_factory=list)
    links: list[_Link] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    changed: bool = False
    urgent: bool = False              # a generation started or ended (several replicas)
    tick_due: bool = False
    later: asyncio.TimerHandle | None = None
    last_load_at: float = -1e9
    queries: int = 0
    hits: int = 0

    def held(self) -> list[int]:
        return [h for g in self.groups for h in self.contexts[g]] + [h for t in self.tails for h in t]

    def _cached(self) -> int:
        return sum(len(self.contexts[g]) for g in self.groups) + sum(len(t) for t in self.tails)

    def start(self, request_id: str, group: int, tail: tuple[int, ...], replica: str = "") -> None:
        """A request starts here, leased by `replica` ("" = none named): its
        prefix enters the cache, its load counts."""
        w = self.spec.workload
        self.queries += w.prompt_tokens
        stored: list[int] = []
        removed: list[int] = []
        if group in self.groups:
            self.groups.move_to_end(group)
            self.hits += w.context_tokens // w.hash_block_tokens * w.hash_block_tokens
        else:
            while self.groups and self._cached() + len(self.contexts[group]) > self.spec.total_blocks:
                removed.extend(self.contexts[self.groups.popitem(last=False)[0]])
            self.groups[group] = None
            stored.extend(self.contexts[group])
        self.tails.append(tail)
        stored.extend(tail)
        if len(self.tails) > _MAX_TAILS:
            removed.extend(self.tails.popleft())
        self.events.append(scheduler_pb2.KvEvents(stored=stored, removed=removed))
        blocks = len(tail) + -(-w.max_tokens // w.hash_block_tokens)
        self.running[request_id] = (group, blocks)
        self.owners[request_id] = replica
        self.note_change(generation=True)

    def end(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            del self.owners[request_id]
            self.note_change(generation=True)

    def note_change(self, generation: bool = False) -> None:
        """Load changed; `generation`: one started or ended (scheduler_link's
        `notify_now`: at once with several replicas)."""
        self.changed = True
        self.urgent = self.urgent or (generation and self.spec.prompt)
        self.wake.set()

    def connected(self) -> set[str]:
        return {link.replica for link in self.links if link.replica}

    def load(self, serving: bool = True, replica: str | None = None) -> scheduler_pb2.LoadReport:
        """The report to `replica` (None: every generation listed)."""
        listed, others = (list(self.running), 0) if replica is None else \
            listed_to(self.owners, self.running, replica, self.connected())
        n = len(self.running)
        groups = {g for g, _ in self.running.values()}
        used = sum(b for _, b in self.running.values()) + sum(len(self.contexts[g]) for g in groups)
        return scheduler_pb2.LoadReport(
            running=min(n, self.spec.max_running), waiting=max(0, n - self.spec.max_running),
            blocks_used=min(used, self.spec.total_blocks), blocks_total=self.spec.total_blocks,
            cached_blocks=self._cached(), serving=serving, queued_tokens=0, request_ids=listed,
            other_replica_generations=others,
            prefix_cache_queries=self.queries, prefix_cache_hits=self.hits,
            prefill_tokens_per_second=20000.0, step_seconds=0.01 + 0.0005 * n, step_token_budget=2048)

    def hello(self, address: str, incarnation: int) -> scheduler_pb2.EngineHello:
        w = self.spec.workload
        return scheduler_pb2.EngineHello(
            engine_id=self.engine_id, address=address, model=w.model, block_size=w.hash_block_tokens,
            total_blocks=self.spec.total_blocks, max_running=self.spec.max_running, weight=1.0,
            max_model_len=32768, hash_block_tokens=w.hash_block_tokens, backend="synthetic",
            incarnation=incarnation, scheduler_replicas=len(self.spec.schedulers))

    def on_command(self, link: _Link, command: scheduler_pb2.SchedulerCommand) -> None:
        kind = command.WhichOneof("cmd")
        if kind == "resync":
            self.counters["resyncs"] += 1
            link.resync = True
            self.wake.set()
        elif kind == "fence":
            for request_id in command.fence.request_ids:
                owner = self.owners.get(request_id, "")
                # fencing.py: only the leasing replica's fence ends a
                # generation (gone replicas' do not happen here).
                if owner and link.replica and owner != link.replica:
                    self.counters["not_fenced"] += 1
                    continue
                self.counters["fenced"] += 1
                self.end(request_id)

    async def write_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Like scheduler_link's writer: KV events at once, load when due."""
        gap = max(0.005, self.spec.report_interval / 4)
        while True:
            await self.wake.wait()
            self.wake.clear()
            for link in self.links:
                if link.resync:
                    await self.send_snapshot(link)
            if self._events_in_reports():
                self.changed = self.changed or bool(self.events)   # they go in the next reports
            else:
                await self._send_events(self.links)
            now = loop.time()
            if self.tick_due or self.urgent or (self.changed and now >= self.last_load_at + gap):
                await self._send_load(loop.time())
            elif self.changed and self.later is None:
                self.later = loop.call_at(self.last_load_at + gap, self._later)

    def _events_in_reports(self) -> bool:
        """Every stream's scheduler reads KV events inside load reports."""
        return bool(self.links) and all(link.kv_in_reports for link in self.links)

    async def _send_events(self, links: list[_Link]) -> None:
        events, self.events = self.events, []
        for kv in events:
            for link in links:
                self.counters["kv_events"] += 1
                link.seq += 1
                kv.seq = link.seq
                await link.call.write(scheduler_pb2.EngineMessage(kv_events=kv))

    def _later(self) -> None:
        self.later = None
        self.wake.set()

    async def send_snapshot(self, link: _Link) -> None:
        link.resync = False
        self.counters["snapshots"] += 1
        await link.call.write(scheduler_pb2.EngineMessage(kv_snapshot=scheduler_pb2.KvSnapshot(
            seq=link.seq, hashes=self.held())))

    async def _send_load(self, now: float) -> None:
        """Each replica's own report; one equal to the last sent on its
        stream is left out until the heartbeat is due."""
        self.changed = self.tick_due = self.urgent = False
        self.last_load_at = now
        events: list[scheduler_pb2.KvEvents] = []
        if self._events_in_reports():
            events, self.events = self.events, []
        for link in self.links:
            report = self.load(replica=link.replica)
            blob = report.SerializeToString(deterministic=True)
            if not events and blob == link.last_blob and now - link.last_sent_at < self.spec.heartbeat:
                self.counters["skipped"] += 1
                continue
            link.last_blob, link.last_sent_at = blob, now
            self.counters["loads"] += 1
            for kv in events:
                self.counters["kv_in_reports"] += 1
                link.seq += 1
                report.kv_events.add(seq=link.seq, stored=kv.stored, removed=kv.removed, cleared=kv.cleared)
            await link.call.write(scheduler_pb2.EngineMessage(load=report))


async def _read_commands(engine: SynthEngine, link: _Link) -> None:
    for key, value in await link.call.initial_metadata() or ():
        if key == REPLICA_METADATA_KEY:
            link.replica = value if isinstance(value, str) else value.decode(errors="replace")
            engine.wake.set()   # its next report lists only its own generations
        elif key == KV_IN_REPORTS_METADATA_KEY:
            link.kv_in_reports = True
    while True:
        message = await link.call.read()
        if message is grpc.aio.EOF:
            return
        engine.on_command(link, cast(scheduler_pb2.SchedulerCommand, message))


class _Datagrams(asyncio.DatagramProtocol):
    """Starts and ends of requests, from the synthetic gateways."""

    def __init__(self, engines: dict[str, SynthEngine]) -> None:
        self._engines = engines

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        parts = data.decode().split()
        engine = self._engines.get(parts[1]) if len(parts) >= 3 else None
        if engine is None:
            return
        if parts[0] == "S" and len(parts) >= 5:
            replica = "" if parts[4] == NO_REPLICA else parts[4]
            engine.start(parts[2], int(parts[3]), tuple(int(h) for h in parts[5:]), replica)
        elif parts[0] == "E":
            engine.end(parts[2])


async def _connect(engine: SynthEngine, address: str, incarnation: int, channels: list[grpc.aio.Channel],
                   tasks: list[asyncio.Task[None]]) -> None:
    """One Connect stream per scheduler, on the engine's own connection."""
    for target in engine.spec.schedulers:
        channel = grpc.aio.insecure_channel(target, options=client_options())
        channels.append(channel)
        link = _Link(scheduler_pb2_grpc.SchedulerStub(channel).Connect())
        await link.call.write(scheduler_pb2.EngineMessage(hello=engine.hello(address, incarnation)))
        await engine.send_snapshot(link)
        engine.links.append(link)
        tasks.append(asyncio.create_task(_read_commands(engine, link)))


async def _sweep(engines: list[SynthEngine], interval: float) -> None:
    """Every interval each engine is due a report, a slice at a time."""
    turn = 0
    while True:
        await asyncio.sleep(interval / _SLICES)
        for engine in engines[turn % _SLICES::_SLICES]:
            engine.tick_due = True
            engine.wake.set()
        turn += 1


async def _host(spec: EngineHostSpec, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    contexts = context_hashes(spec.workload)
    counters = HostCounters()
    engines = [SynthEngine(f"synth-{i}", spec, contexts, counters) for i in range(spec.first, spec.first + spec.count)]
    for i, engine in zip(range(spec.first, spec.first + spec.count), engines, strict=True):
        for g in (2 * i % spec.workload.groups, (2 * i + 1) % spec.workload.groups):
            engine.groups[g] = None
    by_id = {e.engine_id: e for e in engines}
    transport, _ = await loop.create_datagram_endpoint(lambda: _Datagrams(by_id), local_addr=("127.0.0.1", 0))
    address = f"127.0.0.1:{transport.get_extra_info('sockname')[1]}"
    channels: list[grpc.aio.Channel] = []
    tasks: list[asyncio.Task[None]] = []
    # EngineHello.incarnation as scheduler_link.new_incarnation makes it.
    base = (time.time_ns() // 1_000_000) << 22
    for chunk in range(0, len(engines), 64):
        await asyncio.gather(*(_connect(e, address, base + spec.first + chunk + n, channels, tasks)
                               for n, e in enumerate(engines[chunk:chunk + 64])))
    tasks += [asyncio.create_task(e.write_loop(loop)) for e in engines]
    tasks.append(asyncio.create_task(_sweep(engines, spec.report_interval)))
    conn.send(("ready", address))
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        conn.send(("stats", dict(counters), sum(len(e.running) for e in engines)))
        if command == "stop":
            break
    for task in tasks:
        task.cancel()
    for channel in channels:
        with contextlib.suppress(Exception):
            await channel.close()
    transport.close()


def host_main(spec: EngineHostSpec, conn: Connection) -> None:
    """A host process's entry point (multiprocessing, spawn)."""
    import uvloop

    uvloop.run(_host(spec, conn))
