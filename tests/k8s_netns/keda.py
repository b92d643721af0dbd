"""KedaStandIn: what KEDA, the HPA it makes and the StatefulSet controller
do with a rendered ScaledObject, on the namespace-host cluster (which has
no KEDA and no API server).

Each `step()` is one of KEDA's polls: the trigger's query, exactly as
rendered, asked of the real Prometheus pod the overlay runs (its HTTP API,
`/api/v1/query`), which scrapes the scheduler pods' real metrics; the HPA's
decision on that value (hpa.py: ceil(value / threshold), clamped to
[minReplicaCount, maxReplicaCount], the behavior's stabilization windows
and pace); then the target StatefulSet's `spec.replicas` set to it (the
scale subresource) and its pods made or deleted as the StatefulSet
controller would: new ordinals started on new hosts (Parallel), the highest
ordinals deleted, each through kubelet's termination (leaves DNS, preStop
drain, SIGTERM, SIGKILL at the grace period's end; cluster.py).

Two liberties, both stated where they matter: the query is sent from the
Prometheus pod's own network (KEDA's operator would be in the namespace
`keda`, which no host of this harness is in), and a pod's deletion blocks
the poll loop until it is gone (the HPA would go on polling; with at most
one pod per period above the grace period, nothing is decided meanwhile).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster, RunningPod, http_get
from .hpa import Scaling
from .kube import pods

__all__ = ["KedaStandIn", "Reading"]


@dataclass(frozen=True)
class Reading:
    """One poll: when (monotonic), the query's value (None: no series or an
    error, and KEDA then keeps the replicas) and the replicas after it."""

    at: float
    value: float | None
    replicas: int


@dataclass
class KedaStandIn:
    cluster: Cluster
    scaled_object: dict[str, Any]
    clock: Callable[[], float] = time.monotonic
    readings: list[Reading] = field(default_factory=list)
    # (pod, delete_pod's figures and `at`, when its deletion began)
    deleted: list[tuple[str, dict[str, float]]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    scaling: Scaling = field(init=False)
    _hosts: int = 0

    def __post_init__(self) -> None:
        self.scaling = Scaling.of(self.scaled_object)

    @property
    def trigger(self) -> dict[str, str]:
        return dict(self.scaled_object["spec"]["triggers"][0]["metadata"])

    @property
    def interval(self) -> float:
        return float(self.scaled_object["spec"].get("pollingInterval", 30))

    def target(self) -> dict[str, Any]:
        ref = self.scaled_object["spec"]["scaleTargetRef"]
        return self.cluster.objects.get(ref.get("kind", "Deployment"), ref["name"])

    def replicas(self) -> int:
        return int(self.target()["spec"].get("replicas", 1))

    def query(self) -> float | None:
        """The trigger's query on the Prometheus behind its serverAddress."""
        url = urllib.parse.urlsplit(self.trigger["serverAddress"])
        prom = self.cluster.by_component("prometheus")[0]
        addresses = self.cluster.resolve(url.hostname or "", prom.host.name)
        if not addresses:
            return None
        q = urllib.parse.urlencode({"query": self.trigger["query"]})
        get = f"{url.scheme}://{addresses[0]}:{url.port}/api/v1/query?{q}"
        status, body = prom.host.call(lambda: http_get(get, 5.0), timeout=15)
        if status != 200:
            return None
        result = json.loads(body)["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def step(self) -> Reading:
        """One poll and what it changes."""
        now, current = self.clock(), self.replicas()
        value = self.query()
        want = current if value is None else self.scaling.decide(now, value, current)
        while self.replicas() < want:
            self._create()
        while self.replicas() > want:
            self._delete(now)
        reading = Reading(now, value, self.replicas())
        self.readings.append(reading)
        return reading

    def run_until(self, done: Callable[[Reading], bool], timeout: float, what: str) -> Reading:
        """Poll every pollingInterval until done(reading); AssertionError after `timeout`."""
        t0 = self.clock()
        while True:
            reading = self.step()
            if done(reading):
                return reading
            if self.clock() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                     f"last readings {self.readings[-5:]}")
            time.sleep(max(0.0, self.interval - (self.clock() - reading.at)))

    def _create(self) -> RunningPod:
        sts = self.target()
        sts["spec"]["replicas"] = self.replicas() + 1
        pod = next(p for p in pods(self.cluster.objects) if p.name not in self.cluster.running
                   and p.workload == sts["metadata"]["name"])
        self._hosts += 1
        r = self.cluster.create_pod(pod, f"{pod.component[:3]}{pod.name.rsplit('-', 1)[1]}n{self._hosts}")
        self.created.append(pod.name)
        return r

    def _delete(self, decided_at: float) -> None:
        """Scale in by one; `at` is when it was decided -- the time the
        scale-down policy's period counts from (the poll's query before it
        takes a varying time, so the deletion's own moment could make two
        decisions a period apart look a few ms closer)."""
        sts = self.target()
        name = f"{sts['metadata']['name']}-{self.replicas() - 1}"  # the highest ordinal goes first
        sts["spec"]["replicas"] = self.replicas() - 1
        self.deleted.append((name, {"at": decided_at, **self.cluster.delete_pod(name)}))
