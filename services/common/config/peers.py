"""`scheduler.peers`: the other scheduler replicas this one hears the queue
heads of (services/scheduler/peer_heads.py, peer_watch.py).

Why: each replica queues only the requests it owns (the gateway picks the
owner by request id), so without a word between them one replica would fill
a free slot with a P2 while another holds a P1 that could have had it. Each
replica streams the most urgent request waiting per model to the others
(`Scheduler.WatchQueueHeads`), and a replica leaves a slot it could fill to
a more urgent request waiting elsewhere, within the bounds below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PeersConfig"]


@dataclass
class PeersConfig:
    """`scheduler.peers`: where the other replicas are and how long to wait for them."""

    # host:port of every scheduler replica (this one may be listed: it finds
    # itself by its replica name and leaves itself out). `kvmesh up
    # --schedulers N` sets it; on Kubernetes the StatefulSet's pod names.
    # Empty = one scheduler: nothing is held back.
    addresses: list[str] = field(default_factory=list)
    # At most one queue-heads message per watcher this often while the heads
    # change: the bound's propagation part (plus a loopback or LAN hop).
    # 0.02 s: a few percent of a short request's time to first token. > 0.
    publish_interval_seconds: float = 0.02
    # An unchanged replica says so this often, so a silent one is told from a
    # quiet one. > 0.
    heartbeat_seconds: float = 0.5
    # A replica not heard from this long holds nothing back (killed, cut
    # off): priority across replicas then degrades to each replica's own
    # order instead of stalling. 3 heartbeats. > heartbeat_seconds.
    stale_seconds: float = 1.5
    # The longest this replica leaves room it could fill to one more urgent
    # request of another replica (that request may not fit where this room
    # is: another engine, excluded, too long). 0.5 s: ~25 heads messages, long
    # for a replica that will place it at its next report, short for a P2
    # to wait. > 0.
    hold_seconds: float = 0.5
    # A head that left another replica's queue -- placed there, most often --
    # still holds room this long. The placement reaches this replica twice:
    # as that replica's next heads (one hop) and as the engine's report of
    # the generation's start (the gateway, the engine, its report: several
    # hops); on a loaded machine the heads can come first, and the slot the
    # placement took then looks free here until the report. 0.1 s. >= 0.
    vanished_head_seconds: float = 0.1
