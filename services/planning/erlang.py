"""Waiting in a pool of k identical servers (Erlang C, M/M/k) and its split
by priority class (Cobham's non-preemptive priority formula). A fleet of N
engines with a batch cap of M is treated as k = N x M servers, each holding
one request for its service time: a request waits only when every batch
slot of the fleet is taken, which is when the scheduler queues it."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Pool", "class_wait_quantile", "erlang_c"]


@dataclass(frozen=True)
class Pool:
    servers: int              # batch slots of the whole fleet
    offered: float            # Erlangs: arrival rate x service time
    service_seconds: float
    # Allen-Cunneen's (Ca^2 + Cs^2) / 2 for Poisson arrivals: 1 for
    # exponential service times, 0.5 for fixed ones.
    variability: float = 1.0


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) with `servers` servers and `offered` Erlangs
    (arrival rate x service time); 1.0 when offered >= servers."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    # The Erlang B recursion, stable for thousands of servers.
    b = 1.0
    for n in range(1, servers + 1):
        b = offered * b / (n + offered * b)
    rho = offered / servers
    return b / (1.0 - rho + rho * b)


def class_wait_quantile(pool: Pool, shares: list[float], index: int, quantile: float,
                        preemptive: bool = False) -> float:
    """The `quantile` of the queue wait of class `index` (classes in priority
    order, `shares` of the arrivals each), by Cobham's formula: the mean wait
    of class i is W0 / ((1 - s_{i-1})(1 - s_i)), s_i the load of classes
    0..i over the pool and W0 = P_wait x service / servers. A `preemptive`
    class takes its slot from lower classes' running work, so only classes
    0..i make it wait (P_wait from their load alone); the mean is scaled by
    the pool's `variability`. The wait, given that one
    waits, is taken as exponential with that mean (exact for one class of
    M/M/k). inf when the pool is overloaded."""
    servers, offered = pool.servers, pool.offered
    if offered >= servers:
        return math.inf
    seen = offered * sum(shares[:index + 1]) if preemptive else offered
    p_wait = erlang_c(servers, seen)
    rho = offered / servers
    above = rho * sum(shares[:index])
    through = rho * sum(shares[:index + 1])
    mean_wait = pool.variability * p_wait * pool.service_seconds / servers / ((1.0 - above) * (1.0 - through))
    if p_wait <= 1.0 - quantile or mean_wait <= 0:
        return 0.0
    return mean_wait / p_wait * math.log(p_wait / (1.0 - quantile))
