"""Waiting in a pool of k identical servers (Erlang C, M/M/k) and its split
by priority class (Cobham's non-preemptive priority formula). A fleet of N
engines with a batch cap of M is treated as k = N x M servers, each holding
one request for its service time: a request waits only when every batch
slot of the fleet is taken, which is when the scheduler queues it."""

from __future__ import annotations

import math

__all__ = ["class_wait_quantile", "erlang_c"]


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


def class_wait_quantile(servers: int, offered: float, service_seconds: float, shares: list[float],
                        index: int, quantile: float) -> float:
    """The `quantile` of the queue wait of class `index` (classes in priority
    order, `shares` of the arrivals each), non-preemptive priority: the mean
    wait of class i is W0 / ((1 - s_{i-1})(1 - s_i)) with s_i the load of
    classes 0..i over the pool and W0 = P_wait x service / servers; the wait,
    given that one waits, is taken as exponential with that mean (exact for
    one class of M/M/k). inf when the pool is overloaded."""
    if offered >= servers:
        return math.inf
    p_wait = erlang_c(servers, offered)
    rho = offered / servers
    above = rho * sum(shares[:index])
    through = rho * sum(shares[:index + 1])
    mean_wait = p_wait * service_seconds / servers / ((1.0 - above) * (1.0 - through))
    if p_wait <= 1.0 - quantile or mean_wait <= 0:
        return 0.0
    return mean_wait / p_wait * math.log(p_wait / (1.0 - quantile))
