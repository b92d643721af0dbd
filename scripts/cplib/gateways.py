"""Synthetic gateways: open-loop admissions through the gateway's own
scheduler clients (services/gateway/scheduler_replicas.py
`SchedulerReplicas` over services/gateway/scheduler_client.py:
`SchedulerClient`, its spare Admit call, `AdmitSession`), driven in the
order services/gateway/lease_link.py drives them for a request that runs to
its end:

    open(AdmitRequest) -> next_outcome() until Placed   (the decision latency)
    -> the engine starts it (a datagram, engines.py)    -> listen()
    -> first token: first_token(), replenish()          (the next spare call)
    -> the hold ends: the engine ends it, report_done(RequestDone), close()

The AdmitRequest carries what a gateway's Job sends (jobs.py
`admit_request`): model, tenant, priority, prompt and max tokens, the
prompt's prefix hashes and its arrival time. With several scheduler
replicas each request is admitted where the real gateway admits it:
`SchedulerReplicas.open`, the replica its request id ranks first by
rendezvous hashing among the healthy ones; the replica that placed it
(`Placed.scheduler_replica`) goes to the engine with the start, as the
gateway's engine request carries it. The tally counts admissions per
replica and those placed elsewhere than the rendezvous owner (`moved`: 0
while every replica is healthy).

Ownership: one event loop per gateway process; each admission is one task;
the step's figures are appended to by those tasks only, read after the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection

from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import GatewayError
from services.gateway.scheduler_client import AdmitSession
from services.gateway.scheduler_replicas import SchedulerReplicas, rendezvous_order

from .engines import NO_REPLICA
from .plan import arrival_offsets
from .workload import Workload, context_hashes

__all__ = ["GatewaySpec", "StepOrder", "StepTally", "arrival_id", "gateway_main", "merge_tallies", "owner_spread"]

# After the step's arrivals: how long a request may still wait for its
# placement before it counts as unplaced.
_GRACE_SECONDS = 2.0
# How long a gateway waits for every replica's channel to be READY.
_READY_SECONDS = 30.0


def arrival_id(gateway: int, step: int, n: int) -> str:
    """The id of a gateway's n-th arrival of a step."""
    return f"cp{gateway}-{step}-{n}"


def owner_spread(request_ids: Iterable[str], addresses: list[str]) -> dict[str, int]:
    """Requests per replica when each goes to its rendezvous owner (the
    gateway's own `rendezvous_order`): what a healthy run's tally shows."""
    out = dict.fromkeys(addresses, 0)
    for rid in request_ids:
        out[rendezvous_order(rid, addresses)[0]] += 1
    return out


@dataclass(frozen=True)
class GatewaySpec:
    index: int
    schedulers: tuple[str, ...]
    workload: Workload
    hold_min: float = 0.05            # seconds from Placed to RequestDone
    hold_max: float = 0.2
    first_token: float = 0.02         # seconds from Placed to FirstToken (capped by the hold)


@dataclass(frozen=True)
class StepOrder:
    number: int
    rate: float                       # this gateway's share, admissions/s
    seconds: float


@dataclass
class StepTally:
    """What one gateway saw in one step (times in seconds)."""

    sent: int = 0
    latencies: list[float] = field(default_factory=list)   # Admit sent -> Placed
    placed_in_window: int = 0
    queued_messages: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    unplaced: int = 0
    preempted: int = 0
    late: list[float] = field(default_factory=list)        # per arrival: behind its schedule (0 = on time)
    by_replica: dict[str, int] = field(default_factory=dict)   # placed, per replica address
    moved: int = 0                    # placed on a replica other than its rendezvous owner


def merge_tallies(tallies: list[StepTally]) -> StepTally:
    """The gateways' tallies as one: counts added, lists joined, counters merged."""
    out = StepTally()
    for t in tallies:
        for f in fields(StepTally):
            mine, theirs = getattr(out, f.name), getattr(t, f.name)
            if isinstance(mine, dict):
                for key, n in theirs.items():
                    mine[key] = mine.get(key, 0) + n
            else:
                setattr(out, f.name, mine + theirs)
    return out


class _Gateway:
    def __init__(self, spec: GatewaySpec) -> None:
        self.spec = spec
        self.replicas = SchedulerReplicas(list(spec.schedulers))
        self.contexts = context_hashes(spec.workload)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setblocking(False)
        self.rng = random.Random(spec.index * 7717 + 1)

    async def wait_ready(self) -> None:
        """Until every replica's channel is READY (a first request would
        otherwise skip a replica still connecting)."""
        deadline = time.monotonic() + _READY_SECONDS
        while not all(self.replicas.healthy(a) for a in self.replicas.addresses):
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler replicas not ready: {self.replicas.address}")
            await asyncio.sleep(0.05)

    def _request(self, request_id: str) -> tuple[scheduler_pb2.AdmitRequest, int, tuple[int, ...]]:
        w = self.spec.workload
        group, priority, tail = w.pick(self.rng)
        request = scheduler_pb2.AdmitRequest(
            request_id=request_id, model=w.model, tenant=f"t{group % 8}", priority=priority,
            prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens,
            prefix_hashes=self.contexts[group] + tail, arrival_unix=time.time())
        return request, group, tail

    def _placed(self, session: AdmitSession, request_id: str, tally: StepTally) -> None:
        tally.by_replica[session.replica] = tally.by_replica.get(session.replica, 0) + 1
        tally.moved += session.replica != rendezvous_order(request_id, self.replicas.addresses)[0]

    def _engine(self, placed: scheduler_pb2.Placed, message: str) -> None:
        host, _, port = placed.engine_address.rpartition(":")
        with contextlib.suppress(OSError):
            self.udp.sendto(message.encode(), (host, int(port)))

    async def admit(self, request_id: str, tally: StepTally, window_end: float) -> None:
        request, group, tail = self._request(request_id)
        began = time.perf_counter()
        try:
            session = await self.replicas.open(request)
            while True:
                outcome = await session.next_outcome()
                if isinstance(outcome, scheduler_pb2.Placed):
                    break
                tally.queued_messages += 1
        except GatewayError as exc:
            kind = exc.kind.value
            tally.rejected[kind] = tally.rejected.get(kind, 0) + 1
            return
        placed_at = time.perf_counter()
        tally.latencies.append(placed_at - began)
        tally.placed_in_window += placed_at <= window_end
        self._placed(session, request_id, tally)
        await self._run(session, outcome, request_id, group, tail, tally)

    async def _run(self, session: AdmitSession, placed: scheduler_pb2.Placed,
                   request_id: str, group: int, tail: tuple[int, ...], tally: StepTally) -> None:
        replica = placed.scheduler_replica or NO_REPLICA
        self._engine(placed, f"S {placed.engine_id} {request_id} {group} {replica} " + " ".join(map(str, tail)))

        def preempted(_: scheduler_pb2.Preempted) -> None:
            tally.preempted += 1

        session.listen(preempted)
        hold = self.rng.uniform(self.spec.hold_min, self.spec.hold_max)
        first = min(self.spec.first_token, hold)
        try:
            await asyncio.sleep(first)
            await asyncio.sleep(0)   # lease_link: the first token is written first
            await session.first_token()
            self.replicas.replenish()
            await asyncio.sleep(hold - first)
        finally:
            self._engine(placed, f"E {placed.engine_id} {request_id}")
        w = self.spec.workload
        await session.report_done(scheduler_pb2.RequestDone(
            prompt_tokens=w.prompt_tokens, completion_tokens=w.max_tokens,
            cached_tokens=placed.cached_tokens, finish_reason="length"))
        await session.close()

    async def step(self, order: StepOrder) -> StepTally:
        loop = asyncio.get_running_loop()
        tally = StepTally()
        offsets = arrival_offsets(order.rate, order.seconds, seed=order.number * 1009 + self.spec.index)
        start = loop.time() + 0.05
        window_end = time.perf_counter() + 0.05 + order.seconds
        tasks: list[asyncio.Task[None]] = []
        for n, offset in enumerate(offsets):
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tally.late.append(max(0.0, -delay))
            rid = arrival_id(self.spec.index, order.number, n)
            tasks.append(loop.create_task(self.admit(rid, tally, window_end)))
            tally.sent += 1
        await self._finish(tasks, tally)
        return tally

    async def _finish(self, tasks: list[asyncio.Task[None]], tally: StepTally) -> None:
        """Wait for the step's requests; those still unplaced after the
        grace are cancelled and counted."""
        if not tasks:
            return
        deadline = _GRACE_SECONDS + self.spec.hold_max + 1.0
        _, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        tally.unplaced = tally.sent - len(tally.latencies) - sum(tally.rejected.values())

    async def close(self) -> None:
        await self.replicas.close()
        self.udp.close()


async def _serve(spec: GatewaySpec, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    gateway = _Gateway(spec)
    await gateway.wait_ready()
    conn.send(("ready", spec.index))
    while True:
        order = await loop.run_in_executor(None, conn.recv)
        if not isinstance(order, StepOrder):
            break
        conn.send(("tally", await gateway.step(order)))
    await gateway.close()


def gateway_main(spec: GatewaySpec, conn: Connection) -> None:
    """A gateway process's entry point (multiprocessing, spawn)."""
    import uvloop

    uvloop.run(_serve(spec, conn))
