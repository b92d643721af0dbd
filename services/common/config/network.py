"""Silent partitions: how fast every hop notices a peer that vanished without
a reset (`network`), and how the scheduler fences the generations an engine
still runs without a lease (`fencing`). Both under their own key in the YAML;
bounds are checked at load by `validation.py`.

The partition-detection bound (README, RELIABILITY.md) is composed from
these: a gRPC peer that stops answering is dropped after at most
keepalive_time_seconds + keepalive_timeout_seconds without a byte from it
(a ping goes out once the connection has been silent keepalive_time, and the
connection is closed when the ping's ack has not come keepalive_timeout
later). The gateway then migrates each stream of that engine (Replace).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FencingConfig", "NetworkConfig"]


@dataclass
class NetworkConfig:
    """Keepalive of every hop: gateway<->scheduler, gateway<->engine,
    engine<->scheduler (gRPC, both the client and the server side), and
    Envoy -> gateways (HTTP/2 PINGs to the gRPC port, TCP keepalive on the
    HTTP/1.1 port), all from these two settings."""

    # Seconds a connection may stay silent before its side sends a keepalive
    # ping. 5 s: cheap (one 17-byte frame per connection) and half of the
    # 10 s the mesh used before, so a partitioned engine's streams move in
    # ~10 s instead of ~15 s. Servers accept pings every half of this (gRPC
    # closes a connection whose peer pings faster than the server allows:
    # GOAWAY "too_many_pings"). Bounds: 1 .. 600.
    keepalive_time_seconds: float = 5.0
    # Seconds to wait for a ping's ack before the connection is declared dead
    # and closed (its streams end UNAVAILABLE: the gateway migrates them, the
    # scheduler ends the engine's registration and leases). Acks come from
    # gRPC's own I/O threads, not the Python event loop, so a busy loop does
    # not delay them; 5 s is far above a loaded machine's scheduling delay.
    # Bounds: 1 .. 600.
    keepalive_timeout_seconds: float = 5.0

    # A scheduler owes every request an answer at once (Queued, Placed or
    # Rejected): when one has waited this long and the gateway's AdmitMany call
    # to that scheduler heard nothing at all meanwhile, the scheduler is
    # presumed gone (a host cut off, a stopped or wedged process): the call's
    # requests move to another replica and it is passed over until it
    # answers again (services/gateway/many_call.py). A busy scheduler is not
    # silent: its answers to earlier requests keep the call heard. Faster
    # than keepalive (detect_seconds), and it also catches a process whose
    # loop is stuck while gRPC's threads still answer pings. A request that
    # reaches a silent replica before this bound waits it out: shorter moves
    # fewer and sooner, but a scheduler whose loop stalls this long (a loaded
    # machine) gets its calls' requests moved for nothing (they are kept:
    # re-admitted with their arrival time, or re-attached). 0 = off.
    # Bounds: 0 or 0.5 .. 60.
    silent_peer_seconds: float = 1.0

    @property
    def detect_seconds(self) -> float:
        """Longest time a silent peer keeps a connection open."""
        return self.keepalive_time_seconds + self.keepalive_timeout_seconds


@dataclass
class FencingConfig:
    """Lease fencing (services/scheduler/fencing.py): the scheduler's lease
    table is the truth. Each load report lists the generations an engine
    runs; one the scheduler does not lease to that engine (a request that
    migrated away while the engine was cut off, or whose gateway and request
    are gone) is sent back in a `Fence` command and the engine ends it."""

    # Off = the scheduler sends no Fence (engines keep whatever they run
    # until it ends or, detached, its resume grace runs out).
    enabled: bool = True
    # An id must be reported unleased on at least two consecutive reports
    # this many seconds apart before it is fenced: a lease that just ended
    # (`done` racing the engine's last report of it) is not fenced. 1 s = ten
    # reports at the default interval. Bounds: >= 0.
    confirm_seconds: float = 1.0
    # Nothing is fenced this long after the scheduler starts: gateways
    # re-attach the leases of running requests on a restarted scheduler
    # (AdmitRequest.running_on_engine) once their engine has re-registered;
    # engines reconnect within 2 s (their backoff cap) and gateways retry
    # each second. Bounds: >= 0.
    startup_grace_seconds: float = 10.0
    # Nothing is fenced on an engine this long after it (re)registers, for the
    # same re-attachment when it was the engine that came back late. After a
    # healed partition its orphans are fenced this + confirm_seconds after it
    # reconnects. Bounds: >= 0.
    rejoin_grace_seconds: float = 3.0
