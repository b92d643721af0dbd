"""The gateway's scheduler replicas (README "Several schedulers"): one
`SchedulerClient` per configured address (`GatewayConfig.schedulers()`),
and which of them admits each request.

Each request is owned by one replica: its Admit stream goes to the replica
ranked first for its request id by rendezvous hashing (highest
blake2b(request id, address)) among those this gateway has a healthy channel
to -- READY, and no stream of it broke within `_SUSPECT_SECONDS` -- so a retry
of the same request picks the same replica, and removing one replica moves
only its own requests. A replica that cannot be reached when a request
opens is skipped for the next in rank at once. When the owner's stream
breaks, the request's `LeaseLink` opens it again here (re-admitted keeping
its arrival time, or re-attached with `running_on_engine`) -- the path a
scheduler restart already takes -- and the dead replica, now unhealthy, is
passed over. A replica whose channel just turned READY again (a restart)
is not healthy until its engines have reconnected to it
(replica_warmup.py, after `start()`). A replica that went silent on its
AdmitMany call (`answer_seconds`: a host cut off without a reset, a stopped
or wedged process; many_call.py) is not healthy until it answers a GetState
again (`_probe`) or its channel drops (keepalive; then the warm-up above
follows its return): its channel still says READY meanwhile. With one
address every request goes to it, as before.

Ownership: the gateway service owns this object; it is used from the event
loop only. Channel states are read live; `_Replica.suspect_at` is written by
stream callbacks, on the loop; `_Replica.warmup` by its replica_warmup task.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from dataclasses import dataclass, field

import grpc

from services.common.clock import Clock, SystemClock
from services.common.mesh_tls import MeshIdentity
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import SchedulerRestarting
from services.gateway.replica_warmup import Warmup, follow
from services.gateway.scheduler_client import AdmitSession, Reachability, SchedulerClient

__all__ = ["SchedulerReplicas", "rendezvous_order"]

log = logging.getLogger(__name__)

# A replica one of whose streams just broke is passed over this long, while
# its channel may still say READY (a SIGKILLed process's connection reset
# reaches the streams and the channel in either order).
_SUSPECT_SECONDS = 1.0
# A silent replica is asked for its state this often, each ask bounded by
# the same (`_probe`).
_PROBE_SECONDS = 0.5
# A replica whose AdmitMany call has owed an answer this long with nothing
# heard since gets no new request until it is heard again: before it can be
# called silent (`network.silent_peer_seconds`), new requests go to the next
# replica in rank instead of waiting with it. Answers come in milliseconds;
# wrongly passed over, a request only lands on its second choice (every
# replica sees the whole fleet).
_QUIET_SECONDS = 0.1


def _score(request_id: str, address: str) -> int:
    digest = hashlib.blake2b(f"{request_id}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(request_id: str, addresses: list[str]) -> list[str]:
    """`addresses` best first for `request_id` (highest random weight):
    stable for the same id, and dropping one address changes the choice only
    for the ids that ranked it first."""
    return sorted(addresses, key=lambda a: _score(request_id, a), reverse=True)


@dataclass
class _Replica:
    client: SchedulerClient
    suspect_at: float | None = None
    warmup: Warmup = field(default_factory=Warmup)
    silent: asyncio.Task[None] | None = None   # its `_probe`, while it is silent


class SchedulerReplicas:
    """Every scheduler replica this gateway admits on (see the module docstring)."""

    def __init__(self, addresses: list[str], identity: MeshIdentity | None = None,
                 clock: Clock | None = None, answer_seconds: float = 0.0) -> None:
        """`answer_seconds`: `network.silent_peer_seconds` (0 = not watched)."""
        if not addresses:
            raise ValueError("no scheduler address")
        self._clock = clock or SystemClock()
        self._reachability = Reachability()
        self._replicas = {
            a: _Replica(SchedulerClient(a, identity, self._reachability, answer_seconds,
                                        functools.partial(self._went_silent, a)))
            for a in addresses}
        self.addresses = list(addresses)
        self._warmups: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Follow each replica's returns (replica_warmup.py); with one
        address there is nothing to choose, so nothing to follow."""
        if len(self.addresses) < 2 or self._warmups:
            return
        loop = asyncio.get_running_loop()
        for address, replica in self._replicas.items():
            peers = functools.partial(self._warm_peers, address)
            self._warmups.append(loop.create_task(follow(replica.client, peers, replica.warmup, self._clock),
                                                  name=f"warmup-{address}"))

    def _warm_peers(self, address: str) -> list[SchedulerClient]:
        """The other replicas that are ready and not warming themselves."""
        return [r.client for a, r in self._replicas.items()
                if a != address and not r.warmup.warming and r.client.is_ready()]

    @property
    def address(self) -> str:
        """The replicas' addresses, for messages."""
        return ", ".join(self.addresses)

    def client(self, address: str) -> SchedulerClient:
        return self._replicas[address].client

    # ---------------------------------------------------------------- health

    def healthy(self, address: str) -> bool:
        """READY, not warming (back, but its engines not yet), not silent nor
        quiet, and none of its streams broke within `_SUSPECT_SECONDS`."""
        replica = self._replicas[address]
        if replica.warmup.warming or replica.silent is not None or replica.client.unanswered_for() > _QUIET_SECONDS:
            return False
        if replica.suspect_at is not None:
            if self._clock.monotonic() - replica.suspect_at < _SUSPECT_SECONDS:
                return False
            replica.suspect_at = None
        return replica.client.is_ready()

    def suspect(self, address: str) -> None:
        """A stream to it broke, or it could not be reached: pass it over for a while."""
        self._replicas[address].suspect_at = self._clock.monotonic()

    def _went_silent(self, address: str) -> None:
        """Its AdmitMany call went silent: passed over until it answers."""
        replica = self._replicas[address]
        if replica.silent is None:
            replica.silent = asyncio.get_running_loop().create_task(self._probe(address), name=f"silent-{address}")

    async def _probe(self, address: str) -> None:
        replica = self._replicas[address]
        began = self._clock.monotonic()
        try:
            while replica.client.is_ready():
                if await replica.client.get_state(_PROBE_SECONDS) is not None:
                    log.info("scheduler replica %s answers again after %.1f s of silence", address,
                             self._clock.monotonic() - began)
                    return
                await asyncio.sleep(_PROBE_SECONDS)
            log.info("scheduler replica %s: its connection dropped %.1f s after it went silent", address,
                     self._clock.monotonic() - began)
        finally:
            replica.silent = None

    def fail_over(self, session: AdmitSession) -> bool:
        """`session`'s stream broke: its replica is passed over for a while.
        True if another replica is healthy now -- move the request there at
        once instead of backing off for a restart."""
        if session.replica in self._replicas:
            self.suspect(session.replica)
        return any(self.healthy(a) for a in self.addresses if a != session.replica)

    def is_ready(self) -> bool:
        """At least one replica's channel is READY (the gateway can admit)."""
        return any(r.client.is_ready() for r in self._replicas.values())

    async def wait_ready_change(self, ready: bool) -> bool:
        """`is_ready()` once it may differ from `ready`: at once if it does
        now, else after any replica's channel changed state."""
        clients = [r.client for r in self._replicas.values()]
        states = [c.channel.get_state(try_to_connect=True) for c in clients]
        if any(s == grpc.ChannelConnectivity.READY for s in states):
            self._reachability.answered = True
            if not ready:
                return True
        elif ready:
            return False
        waits = [asyncio.ensure_future(c.wait_ready_change(s)) for c, s in zip(clients, states, strict=True)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.is_ready()

    # ---------------------------------------------------------------- admission

    def ranked(self, request_id: str) -> list[str]:
        """The replicas to try for `request_id`, in order: the healthy ones by
        rendezvous rank, then the others (a fast failure each) by rank."""
        order = rendezvous_order(request_id, self.addresses)
        healthy = [a for a in order if self.healthy(a)]
        return healthy + [a for a in order if a not in healthy]

    async def open(self, request: scheduler_pb2.AdmitRequest) -> AdmitSession:
        """Open the request's Admit stream on its replica; one that cannot be
        reached is skipped for the next. All unreachable: the last error."""
        failed: SchedulerRestarting | None = None
        for address in self.ranked(request.request_id):
            try:
                session = await self._replicas[address].client.open(request)
            except SchedulerRestarting as exc:
                self.suspect(address)
                failed = exc
                continue
            session.replica = address
            session.on_broken(functools.partial(self.suspect, address))
            return session
        if failed is None:  # unreachable: ranked() lists every replica
            raise RuntimeError("no scheduler replica to try")
        raise failed

    def replenish(self) -> None:
        """Open the next request's Admit stream ahead on every healthy replica
        (the one scheduler: always, as it always was)."""
        for address in self.addresses:
            if len(self.addresses) == 1 or self.healthy(address):
                self._replicas[address].client.replenish()

    async def get_state(self, timeout: float) -> scheduler_pb2.SchedulerState | None:
        """The first healthy replica's state (each sees the whole fleet)."""
        for address in self.ranked(""):
            state = await self._replicas[address].client.get_state(timeout)
            if state is not None:
                return state
        return None

    async def close(self) -> None:
        self._warmups.extend(r.silent for r in self._replicas.values() if r.silent is not None)
        for task in self._warmups:
            task.cancel()
        await asyncio.gather(*self._warmups, return_exceptions=True)
        self._warmups.clear()
        for replica in self._replicas.values():
            await replica.client.close()
