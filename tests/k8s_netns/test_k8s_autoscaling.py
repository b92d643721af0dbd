"""The rendered `autoscaling` overlay on namespace hosts (cluster.py): the
dev-cpu mesh with the engine StatefulSet's replicas left to the autoscaler
(the manifest sets none: one engine pod to start with), and the overlay's
own Prometheus pod (the Debian `prometheus` binary run as the manifest says,
scraping the scheduler pods through the cluster DNS). KEDA is not here:
KedaStandIn (keda.py) polls the ScaledObject's query on that Prometheus,
applies the HPA's arithmetic (hpa.py) and scales the StatefulSet's pods.

Shown: queued load through Envoy raises the scheduler's real
kvmesh_scheduler_desired_engines, the stand-in scales the engines out to it
and a new engine pod starts, registers and serves; when the load falls to a
trickle the figure falls, and after the stabilization window an engine pod
is deleted -- out of DNS, its preStop drain, SIGTERM -- while streams run,
with none of them lost.

One change to the rendered ScaledObject, for a test's time: the scale-down
window 300 s -> 20 s and the period 120 s -> 30 s (still above the engines'
30 s grace period, the wiring rule). Everything else is as rendered.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from tests.netns.mesh import metric

from .cluster import Cluster
from .keda import KedaStandIn, Reading
from .kube import ROOT
from .load import ClosedLoad
from .running import API_KEY, running_cluster
from .test_k8s_netns import _engine_metrics, _model, _served

# vllm_lane: 2.5 minutes that would make the other lane of `make test` the long one.
pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_lane]

OVERLAY = ROOT / "deploy" / "overlays" / "autoscaling"
DESIRED = "kvmesh_scheduler_desired_engines"
# Concurrent clients: well above what one sim engine runs at once
# (engines.template.max_running 64), so requests queue in the scheduler.
HEAVY_WORKERS = 160
# A trickle: the figure falls back, yet streams run on every engine as one leaves.
LIGHT_WORKERS = 8
TOKENS = 300
TEST_WINDOW_SECONDS = 20
TEST_PERIOD_SECONDS = 30


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from running_cluster(OVERLAY, tmp_path_factory.mktemp("k8s-autoscaling"))


def _for_a_test(scaled_object: dict[str, Any]) -> dict[str, Any]:
    so = copy.deepcopy(scaled_object)
    down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    down["stabilizationWindowSeconds"] = TEST_WINDOW_SECONDS
    for policy in down["policies"]:
        policy["periodSeconds"] = TEST_PERIOD_SECONDS
    return so


def _figure(kube: Cluster) -> list[float]:
    """Each scheduler pod's own desired-engines figure for the engines' model, read from its /metrics."""
    return [metric(kube.http_get(r, {"port": "metrics", "path": "/metrics"})[1], DESIRED, f'model="{_model(kube)}"')
            for r in kube.by_component("scheduler")]


def _held(kube: Cluster, pod: str) -> float:
    """Requests engine pod `pod` runs or holds waiting (0 while it is not listening yet)."""
    try:
        text = _engine_metrics(kube, kube.running[pod])
    except OSError:
        return 0.0
    return metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")


def _engines(kube: Cluster) -> list[str]:
    return sorted(r.pod.name for r in kube.by_component("engine"))


def test_engines_scale_out_on_queued_load_and_in_through_the_drain(kube: Cluster) -> None:
    scheduler = kube.by_component("scheduler")[0]
    if DESIRED not in kube.http_get(scheduler, {"port": "metrics", "path": "/metrics"})[1]:
        pytest.skip(f"the scheduler does not export {DESIRED} (the autoscale branch adds it)")
    keda = KedaStandIn(kube, _for_a_test(kube.objects.get("ScaledObject", "kvmesh-engine")))
    assert _engines(kube) == ["kvmesh-engine-0"], "the manifest sets no replicas: one pod to start with"
    prom = kube.by_component("prometheus")[0]
    kube.wait_for(lambda: keda.query() is not None, 60, "Prometheus to have scraped the figure", check=prom)
    base = keda.run_until(lambda r: r.value is not None, 30, "a first reading")
    print(f"idle: figure {base.value} (per scheduler {_figure(kube)}), {base.replicas} engine(s)")
    start = base.replicas

    envoy = kube.by_component("envoy")[0]
    url = f"http://{envoy.ip}:{kube.service_port('kvmesh-envoy')}"
    load = ClosedLoad(kube, url, API_KEY, _model(kube), TOKENS)
    load.start(HEAVY_WORKERS, timeout=800)
    try:
        out = keda.run_until(lambda r: r.replicas > start, 180, "a scale-out on queued load")
        new = kube.running[keda.created[0]]
        kube.wait_started(new, timeout=120)
        kube.wait_for(lambda: _served(kube, new) > 0, 120, f"{new.pod.name} to serve", check=new)
        print(f"heavy load ({HEAVY_WORKERS} clients): figure {out.value} -> {out.replicas} engines, "
              f"{new.pod.name} ready {new.passed.get('readinessProbe', 0):.1f} s after its start and serving")

        load.workers = LIGHT_WORKERS
        held: dict[str, float] = {}  # what each engine pod held at the last poll
        at_deletion: dict[str, float] = {}  # what each deleted pod held at the poll before its deletion

        def back(r: Reading) -> bool:
            for name, _ in keda.deleted:
                at_deletion.setdefault(name, held.get(name, 0.0))
            held.clear()
            held.update({pod: _held(kube, pod) for pod in _engines(kube)})
            return r.replicas <= start

        keda.run_until(back, 400, "the scale-in back to the idle count once the load fell")
        print(f"light load ({LIGHT_WORKERS} clients): deleted {[(n, at_deletion[n]) for n, _ in keda.deleted]} "
              f"(pod, streams held); preStop / exit after SIGTERM "
              f"{[(round(f['prestop'], 1), round(f['exit'], 1)) for _, f in keda.deleted]} s; "
              f"readings {[(round(r.at - base.at), r.value, r.replicas) for r in keda.readings]}")
        peak = max(r.replicas for r in keda.readings)
        assert keda.deleted[0][0] == f"kvmesh-engine-{peak - 1}", "the highest ordinal leaves first"
        times = [f["at"] for _, f in keda.deleted]
        assert all(b - a >= TEST_PERIOD_SECONDS for a, b in itertools.pairwise(times)), \
            f"more than one engine pod per {TEST_PERIOD_SECONDS} s: {times}"
        assert not any(f["killed"] for _, f in keda.deleted), "an engine pod outlived its grace period"
        assert any(at_deletion.values()), f"no deleted engine held a stream when it left: {at_deletion}"
    finally:
        load.stop(timeout=200)
    lost = load.lost()
    print(f"streams: {len(load.streams)}, lost {len(lost)}")
    assert not lost, f"{len(lost)} of {len(load.streams)} streams lost: {[(s.status, s.error) for s in lost[:3]]}"
