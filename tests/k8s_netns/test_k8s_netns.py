"""The rendered `dev-cpu` overlay run across namespace hosts: 2 scheduler
replicas, 2 gateways, 3 sim engines, the batch service, Redis and Envoy, each pod its own host with exactly the
container's argv, env and volumes (cluster.py), Service names answered by a
real DNS server (dnsmasq) like cluster DNS, NetworkPolicies as nftables in
each host. Shown:

- every startup/readiness/liveness probe answers as the manifest expects;
- a chat request through Envoy's Service port from a client host outside
  the cluster streams to [DONE] (with the key the secrets script made);
- the NetworkPolicies' intent: the client reaches Envoy's 8080, not an
  engine's gRPC port nor the scheduler's; every gateway and engine reaches
  every scheduler replica;
- the scheduler StatefulSet's replicas, dialled by their pod names under the
  headless Service (the ConfigMap's scheduler_addresses): each has every
  engine reporting, names itself after its pod in GetState, and admits
  requests; one rescheduled to a new address under streams loses no stream,
  and engines and gateways find it again by its name within seconds;
- an engine "rescheduled" (killed, the same pod started on a new host with
  a new address, its DNS name moved) under streams: every stream completes
  with the uninterrupted text, the pod serves again within seconds and is
  placed on;
- preStop drains (the manifest's exec hook returns once drained, streams go
  on elsewhere), then SIGTERM ends the engine quickly;
- the operator's tools as `kubectl port-forward` reaches them (from the
  pod's own loopback): `kvmesh admin` with the admin token and certificate
  the secrets script made, `kvmesh top --once`; Envoy's stats port answers
  only GET /stats/prometheus, and the client outside cannot reach it;
- the Batch API (the StatefulSet kvmesh-batch, its SQLite file on its
  PersistentVolumeClaim): a batch of 200 lines through Envoy, the batch pod
  SIGKILLed mid-batch and restarted by "kubelet" on the same claim, ends
  `completed` with 200 results, each custom_id once, no error line;
- the shared Redis (the Deployment kvmesh-redis, redis-server as the
  manifest runs it): a 10-turn Responses conversation through Envoy with
  previous_response_id is 200 on every turn, also after the gateway pod
  that stored the previous turn was SIGKILLed (the other one continues
  it); only gateways and the scheduler reach Redis, and the scheduler's
  incarnation record is there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.netns.client import Stream, run_on, run_streams, wait_until
from tests.netns.harness import Host
from tests.netns.mesh import metric

from .cluster import Cluster, RunningPod, connect
from .kube import ROOT, resolve_port
from .running import API_KEY, running_cluster

pytestmark = pytest.mark.timeout(240)

OVERLAY = ROOT / "deploy" / "overlays" / "dev-cpu"
# Seconds a rescheduled engine pod may take from its start to serving
# (startup + readiness probes pass, registered): a Python service's imports
# and the sim's warm-up take ~3 s on an idle 2-core machine; x5 for a loaded CI.
RESCHEDULE_BOUND_SECONDS = 15.0
# A replacement for an engine on a lost node is ready (registered) as soon
# as it has started (model loaded, warm-up done), not locked out until the
# lost one's keepalive expires (5 + 5 s after the cut): measured from its
# startup probe's pass to its readiness probe's, which leaves the process's
# own start-up time (1-5 s here, idle to loaded) out; half the keepalive
# bound is far above a registration's round trip and tells a lock-out apart.
LOST_BOUND_FRACTION = 0.5
STREAMS = 12
TOKENS = 400


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from running_cluster(OVERLAY, tmp_path_factory.mktemp("k8s"))


# ---------------------------------------------------------------- helpers


def _envoy_url(kube: Cluster) -> str:
    envoy = kube.by_component("envoy")[0]
    return f"http://{envoy.ip}:{kube.service_port('kvmesh-envoy')}"


def _streams(kube: Cluster, streams: list[Stream], during: Any = None, timeout: float = 150) -> None:
    """Run `streams` from the client host through Envoy; `during(streams)`
    once every stream has its first chunk, on this (the root namespace's)
    thread: threads the client host's loop starts would be in its namespace."""
    flowing = threading.Event()
    box: dict[str, BaseException] = {}

    async def run() -> None:
        tasks, session = run_streams(_envoy_url(kube), streams, api_key=API_KEY)
        try:
            await wait_until(lambda: all(s.chunks or s.error for s in streams), 60, "every stream's first chunk")
            flowing.set()
            await asyncio.gather(*tasks)
        finally:
            await session.close()

    def client() -> None:
        try:
            run_on(kube.net.hosts["client"], run, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc
        finally:
            flowing.set()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    if during is not None:
        flowing.wait(timeout)
        if "error" not in box:
            during(streams)
    thread.join(timeout + 20)
    if "error" in box:
        raise box["error"]
    assert not thread.is_alive(), f"streams still running after {timeout} s"


def _prompts(tag: str, n: int) -> list[str]:
    return [f"{tag} {i}: tell me about pods, nodes and services." for i in range(n)]


def _complete(kube: Cluster, prompts: list[str], tokens: int, during: Any = None) -> list[Stream]:
    streams = [Stream(p, tokens, model=_model(kube)) for p in prompts]
    _streams(kube, streams, during)
    return streams


def _model(kube: Cluster) -> str:
    """The model the engines serve, from the mesh config in the ConfigMap."""
    cm = next(c for c in kube.objects.of("ConfigMap") if "kvmesh.yaml" in (c.get("data") or {}))
    config = yaml.safe_load(cm["data"]["kvmesh.yaml"])
    return str(config["engines"]["template"].get("model") or config["models"][0]["name"])


def _engine_name(i: int) -> str:
    return f"kvmesh-engine-{i}"


def _engine_metrics(kube: Cluster, r: RunningPod) -> str:
    return kube.http_get(r, {"port": "metrics", "path": "/metrics"})[1]


def _served(kube: Cluster, r: RunningPod) -> float:
    """Prompt tokens engine pod `r` has processed."""
    return metric(_engine_metrics(kube, r), "vllm:prompt_tokens_total")


def _assert_ok(streams: list[Stream], expected: list[str] | None = None) -> None:
    bad = [(i, s.status, s.finish_reason, s.error) for i, s in enumerate(streams) if not s.ok]
    assert not bad, f"{len(bad)} of {len(streams)} streams failed: {bad[:3]}"
    if expected is not None:
        diff = [i for i, (s, want) in enumerate(zip(streams, expected, strict=True)) if s.text != want]
        assert not diff, f"streams {diff} differ from the uninterrupted run"


# ---------------------------------------------------------------- tests


def test_each_container_runs_as_its_manifest_says(kube: Cluster) -> None:
    """User, read-only root, volumes at their mount paths, hostname = pod name."""
    for r in kube.running.values():
        assert r.proc is not None and r.proc.poll() is None, r.pod.name
        status = Path(f"/proc/{r.proc.pid}/status").read_text()
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        assert uid == (r.container.user or 0), (r.pod.name, uid)
        mounts = {}
        for line in Path(f"/proc/{r.proc.pid}/mountinfo").read_text().splitlines():
            fields = line.split()
            mounts[fields[4]] = fields[5].split(",")  # mount point -> per-mount options (last one wins)
        if r.container.read_only_root:
            assert "ro" in mounts["/"], (r.pod.name, mounts["/"])
        for vol in r.container.volumes:
            assert vol.path in mounts, (r.pod.name, vol.path)
            assert ("ro" in mounts[vol.path]) == vol.read_only, (r.pod.name, vol.path, mounts[vol.path])
        assert kube.exec(r, ["hostname"], timeout=10).stdout.strip() == r.pod.name


def test_every_probe_answers_as_the_manifest_expects(kube: Cluster) -> None:
    for r in kube.running.values():
        for kind, probe in r.container.probes.items():
            assert kube.probe(r, probe), f"{r.pod.name}: {kind} {probe} fails"
            if "httpGet" in probe:
                status, body = kube.http_get(r, probe["httpGet"])
                assert status == 200 and yaml.safe_load(body).get("status"), (r.pod.name, kind, status, body)


def _chat(url: str, model: str) -> list[str]:
    """A streamed chat completion; the SSE data lines up to [DONE]."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": 24,
                       "messages": [{"role": "user", "content": "Hello from outside the cluster"}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    data = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data.append(line[5:].strip())
                if data[-1] == "[DONE]":
                    break
    return data


def test_chat_through_envoy_streams_to_done(kube: Cluster) -> None:
    client, model = kube.net.hosts["client"], _model(kube)
    envoy = kube.by_component("envoy")[0]
    # The Service's port, and its nodePort (dev-cpu: NodePort) on the pod's host standing in for the node.
    urls = [_envoy_url(kube)]
    if kube.objects.get("Service", "kvmesh-envoy")["spec"].get("type") == "NodePort":
        urls.append(f"http://{envoy.ip}:{kube.service_port('kvmesh-envoy', node=True)}")
    for url in urls:
        events = client.call(lambda u=url: _chat(u, model), timeout=90)  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
        assert events and events[-1] == "[DONE]", (url, events[-3:])
        text = "".join((json.loads(e)["choices"][0].get("delta") or {}).get("content") or ""
                       for e in events[:-1] if json.loads(e).get("choices"))
        assert text, f"{url}: no content in {events[:3]}"
    streams = _complete(kube, _prompts("chat", 2), 32)
    _assert_ok(streams)
    assert all(s.text for s in streams)


# A connection tried: from (host, its name in messages), to (pod, port), and whether the policies allow it.
_Check = tuple[Host, str, RunningPod, int, bool]


def test_network_policies_let_the_client_reach_envoy_only(kube: Cluster) -> None:
    client = kube.net.hosts["client"]
    envoy = kube.by_component("envoy")[0]
    sched = kube.by_component("scheduler")[0]
    engine = kube.running[_engine_name(0)]
    gateway = kube.by_component("gateway")[0]
    batch = kube.running[BATCH_POD]

    def from_client(dst: RunningPod, port: int, allowed: bool) -> _Check:
        return client, "the client", dst, port, allowed

    def from_(src: RunningPod, dst: RunningPod, port: int, allowed: bool) -> _Check:
        return src.host, src.pod.name, dst, port, allowed

    checks = [from_client(envoy, 8080, True)]
    checks += [from_client(r, port, False) for r, port in ((engine, 50100), (engine, 9200), (sched, 50051),
                                                           (sched, 9101), (gateway, 8000), (gateway, 50061))]
    # Every scheduler replica from every gateway and engine (each dials them all).
    checks += [from_(src, r, 50051, True) for r in kube.by_component("scheduler")
               for src in (*kube.by_component("gateway"), *kube.by_component("engine"))]
    # Inside the namespace too: engines only from gateways and the scheduler,
    # metrics ports only from the monitoring namespace (no host here).
    checks += [from_(gateway, sched, 50051, True), from_(gateway, engine, 50100, True),
               from_(sched, engine, 50100, True), from_(envoy, gateway, 8000, True)]
    checks += [from_(src, dst, port, False) for src, dst, port in (
        (envoy, engine, 50100), (envoy, sched, 50051), (gateway, engine, 9200), (envoy, gateway, 9102),
        (engine, sched, 9101))]
    # The batch service: its API from Envoy only, its lines out through Envoy's listener.
    checks += [from_(envoy, batch, 8090, True), from_(batch, envoy, 8080, True)]
    checks += [from_(src, batch, port, False) for src, port in ((gateway, 8090), (engine, 8090), (envoy, 9190))]
    checks += [from_client(batch, port, False) for port in (8090, 9190)]

    def attempt(check: _Check) -> str:
        host, _, dst, port, _ = check
        return host.call(lambda: connect(dst.ip, port, 1.5), timeout=10)

    # All at once: a refused port answers at once, a dropped SYN only at its
    # 1.5 s timeout (16 of those one after another were 24 s of waiting).
    with ThreadPoolExecutor(max_workers=len(checks)) as pool:
        outcomes = list(pool.map(attempt, checks))
    for (_, source, dst, port, allowed), outcome in zip(checks, outcomes, strict=True):
        if allowed:
            assert outcome == "connected", f"{source} did not reach {dst.pod.name}:{port}: {outcome}"
        else:
            assert outcome in ("refused", "timeout"), f"{source} reached {dst.pod.name}:{port}"


def _on_pod_loopback(kube: Cluster, r: RunningPod, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvmesh ARGS` on this machine through `kubectl port-forward` to pod r:
    its connections start on the pod's loopback (network namespace only:
    the operator's files are this machine's)."""
    operator = kube.run_dir / "secrets" / "operator.yaml"
    argv = ["ip", "netns", "exec", r.host.ns, sys.executable, "-m", "services.cli", "--config", str(operator),
            *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})


def test_operator_tools_through_port_forward(kube: Cluster) -> None:
    sched = kube.by_component("scheduler")[0]
    token = ["--token-file", str(kube.run_dir / "secrets" / "admin-token")]
    done = _on_pod_loopback(kube, sched, "admin", *token, "pause", "P2")
    assert done.returncode == 0, done.stdout + done.stderr
    state = _on_pod_loopback(kube, sched, "admin", *token, "state")
    assert state.returncode == 0 and "paused: P2" in state.stdout, state.stdout + state.stderr
    assert _on_pod_loopback(kube, sched, "admin", *token, "resume", "P2").returncode == 0
    # A wrong token is refused (the Admin service checks it, not only the certificate).
    bad = kube.run_dir / "bad-token"
    bad.write_text("kvma-wrong\n")
    refused = _on_pod_loopback(kube, sched, "admin", "--token-file", str(bad), "state")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stdout + refused.stderr, refused
    top = _on_pod_loopback(kube, sched, "top", "--once", "--interval", "0.5")
    assert top.returncode == 0 and _engine_name(0) in top.stdout, top.stdout + top.stderr


def _schedulers(kube: Cluster) -> list[RunningPod]:
    return sorted(kube.by_component("scheduler"), key=lambda r: r.pod.name)


def _scheduler_metric(kube: Cluster, r: RunningPod, name: str, labels: str = "") -> float:
    return metric(kube.http_get(r, {"port": "metrics", "path": "/metrics"})[1], name, labels)


def _fresh_engines(kube: Cluster, r: RunningPod) -> float:
    """Engines reporting to scheduler replica `r` now."""
    return _scheduler_metric(kube, r, "kvmesh_scheduler_engines", 'state="fresh"')


def _admitted(kube: Cluster, r: RunningPod) -> float:
    return _scheduler_metric(kube, r, "kvmesh_scheduler_admissions_total")


def _admit_on_every_replica(kube: Cluster, tag: str, bound: float, since: float | None = None) -> float:
    """Short requests through Envoy until each scheduler replica admitted one
    (each request's owner is its id's rendezvous pick: 12 at a time miss a
    replica with probability 2^-11); seconds from `since` (default: now), < bound."""
    t0 = time.monotonic() if since is None else since
    before = {r.pod.name: _admitted(kube, r) for r in _schedulers(kube)}
    batch = 0
    while any(_admitted(kube, r) <= before[r.pod.name] for r in _schedulers(kube)):
        counts = {r.pod.name: _admitted(kube, r) - before[r.pod.name] for r in _schedulers(kube)}
        assert time.monotonic() - t0 < bound, f"not every scheduler replica admitted a request: {counts}"
        _assert_ok(_complete(kube, _prompts(f"{tag} {batch}", STREAMS), 16))
        batch += 1
    waited = time.monotonic() - t0
    assert waited < bound, f"every scheduler replica admitted a request only {waited:.1f} s on (bound {bound} s)"
    return waited


def test_every_scheduler_replica_sees_every_engine_and_admits(kube: Cluster) -> None:
    """The StatefulSet's replicas, dialled by their pod names under the
    headless Service: each has every engine reporting (engines connect to
    every replica the ConfigMap lists), GetState (`kvmesh top` from the pod's
    loopback) lists every engine and names the replica after its pod, and the
    gateways admit requests on each; each replica hears the other's queue heads
    across hosts (scheduler.peers: the NetworkPolicy lets the replicas reach
    each other's gRPC port)."""
    scheds = _schedulers(kube)
    assert [r.pod.name for r in scheds] == ["kvmesh-scheduler-0", "kvmesh-scheduler-1"]
    engines = sorted(r.pod.name for r in kube.by_component("engine"))
    for r in scheds:
        kube.wait_for(lambda r=r: _fresh_engines(kube, r) == len(engines), 30,  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
                      f"every engine reporting to {r.pod.name}", check=r)
        top = _on_pod_loopback(kube, r, "top", "--once", "--interval", "0.5")
        assert top.returncode == 0, top.stdout + top.stderr
        assert all(e in top.stdout for e in engines), (r.pod.name, top.stdout)
        assert f"(replica {r.pod.name}/" in top.stdout, (r.pod.name, top.stdout[:300])
        kube.wait_for(lambda r=r: _scheduler_metric(kube, r, "kvmesh_scheduler_peers_fresh") == len(scheds) - 1,  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
                      30, f"{r.pod.name} hearing the other replica's queue heads", check=r)
    _admit_on_every_replica(kube, "replicas", 60)


def _readmissions(kube: Cluster) -> float:
    """Requests the gateways moved to another scheduler replica (re-admitted or re-attached)."""
    return sum(metric(kube.http_get(r, {"port": "metrics", "path": "/metrics"})[1],
                      "kvmesh_gateway_scheduler_readmissions_total") for r in kube.by_component("gateway"))


def test_rescheduled_scheduler_replica_is_found_again_and_no_stream_is_lost(kube: Cluster) -> None:
    """kvmesh-scheduler-1 deleted under streams and made again on a new host
    (new address, same name): the streams it owned move to the other replica
    with the text unchanged; every engine reports to the new pod and the
    gateways admit on it again within RESCHEDULE_BOUND_SECONDS of its
    readiness: they look its name up again (measured 1.9-5.4 s after its
    readiness, loaded machine; 11-13 s in 3 runs of 4 with gRPC's default
    30 s between DNS resolutions in the gateway's scheduler channel)."""
    prompts = _prompts("sched-move", STREAMS)
    expected = [s.text for s in _complete(kube, prompts, TOKENS)]
    moved: dict[str, Any] = {"before": _readmissions(kube)}

    def reschedule(streams: list[Stream]) -> None:
        old = kube.running["kvmesh-scheduler-1"]
        new = kube.reschedule("kvmesh-scheduler-1", "schedu1b")
        moved.update(old=old.ip, pod=new, ready=kube.wait_started(new, RESCHEDULE_BOUND_SECONDS * 4),
                     ready_at=time.monotonic())

    streams = [Stream(p, TOKENS, model=_model(kube)) for p in prompts]
    _streams(kube, streams, during=reschedule)
    _assert_ok(streams, expected)
    moved_requests = _readmissions(kube) - moved["before"]
    assert moved_requests > 0, "no stream was on the rescheduled replica (none moved to the other)"
    new: RunningPod = moved["pod"]
    assert new.ip != moved["old"]
    engines = len(kube.by_component("engine"))
    kube.wait_for(lambda: _fresh_engines(kube, new) == engines, RESCHEDULE_BOUND_SECONDS,
                  f"every engine reporting to the new {new.pod.name}", check=new)
    reporting = time.monotonic() - moved["ready_at"]
    admitting = _admit_on_every_replica(kube, "sched-moved", RESCHEDULE_BOUND_SECONDS, since=moved["ready_at"])
    print(f"rescheduled {new.pod.name} {moved['old']} -> {new.ip} under {STREAMS} streams ({moved_requests:g} "
          f"moved to the other replica): ready {moved['ready']:.1f} s after its start; every engine reporting "
          f"{reporting:.1f} s, the gateways admitting on it {admitting:.1f} s after it was ready")


def test_envoy_stats_port_serves_only_prometheus_stats(kube: Cluster) -> None:
    envoy = kube.by_component("envoy")[0]
    status, body = kube.http_get(envoy, {"port": "metrics", "path": "/stats/prometheus"})
    assert status == 200, body[:300]
    healthy = [line for line in body.splitlines() if line.startswith("envoy_cluster_membership_healthy{")
               and "gateway_" in line]
    assert len(healthy) == 2 and all(float(line.split()[-1]) == 2 for line in healthy), healthy
    for path in ("/config_dump", "/quitquitquit", "/stats", "/clusters"):
        assert kube.http_get(envoy, {"port": "metrics", "path": path})[0] == 404, path
    port = resolve_port("metrics", envoy.container.ports)
    assert kube.net.hosts["client"].call(lambda: connect(envoy.ip, port, 1.5), timeout=10) in ("refused", "timeout")


BATCH_LINES = 200
BATCH_TOKENS = 8
# Lines done before the batch pod is killed: well into the batch, far from its end.
BATCH_KILL_AFTER = 30
BATCH_POD = "kvmesh-batch-0"
BATCH_DONE = ("completed", "failed", "expired", "cancelled")


def _api(kube: Cluster, method: str, path: str, body: bytes | None = None,
         content_type: str = "application/json") -> tuple[int, bytes]:
    """One call to the public API through Envoy's Service from the client host;
    (status, body), or (0, the error) when the connection fails."""
    def call() -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {API_KEY}", **({"Content-Type": content_type} if body else {})}
        req = urllib.request.Request(_envoy_url(kube) + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError as exc:
            return 0, str(exc).encode()
    return kube.net.hosts["client"].call(call, timeout=30)


def _upload(kube: Cluster, data: bytes) -> str:
    boundary = "kvmesh-k8s-netns-batch"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="lines.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    status, out = _api(kube, "POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}")
    assert status == 200, out[:300]
    return str(json.loads(out)["id"])


def _batch_state(kube: Cluster, batch_id: str) -> dict[str, Any] | None:
    """The batch as GET /v1/batches/{id} answers; None while the API is
    unreachable (the batch pod restarting: Envoy answers 503)."""
    status, out = _api(kube, "GET", f"/v1/batches/{batch_id}")
    return json.loads(out) if status == 200 else None


def _wait_batch(kube: Cluster, batch_id: str, done: Any, timeout: float, what: str,
                poll: float = 0.5) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def check() -> bool:
        box["batch"] = _batch_state(kube, batch_id) or box.get("batch")
        return box.get("batch") is not None and bool(done(box["batch"]))
    kube.wait_for(check, timeout, f"{what} (last seen: {box.get('batch')})", poll=poll)
    return dict(box["batch"])


def test_batch_survives_a_sigkill_of_its_pod(kube: Cluster) -> None:
    model = _model(kube)
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "max_tokens": BATCH_TOKENS, "temperature": 0,
                                  "messages": [{"role": "user", "content": f"batch line {i}: what is a pod?"}]}})
             for i in range(BATCH_LINES)]
    t0 = time.monotonic()
    file_id = _upload(kube, ("\n".join(lines) + "\n").encode())
    status, out = _api(kube, "POST", "/v1/batches", json.dumps(
        {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}).encode())
    assert status == 200, out[:300]
    batch_id = str(json.loads(out)["id"])
    mid = _wait_batch(kube, batch_id, lambda b: b["request_counts"]["completed"] >= BATCH_KILL_AFTER
                      or b["status"] in BATCH_DONE, 90, f"{BATCH_KILL_AFTER} lines of the batch done", poll=0.05)
    assert mid["status"] == "in_progress" and mid["request_counts"]["completed"] < BATCH_LINES, (
        f"the batch was no longer running when the pod was to be killed: {mid}")
    killed_at = time.monotonic()
    restarted = kube.restart(BATCH_POD)  # SIGKILL, then kubelet starts the container again on the same claim
    ready = kube.wait_started(restarted, 60)
    end = _wait_batch(kube, batch_id, lambda b: b["status"] in BATCH_DONE, 150, "the batch to end")
    assert end["status"] == "completed", end
    assert end["request_counts"] == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}, end
    assert not end.get("error_file_id"), f"error lines: {end}"
    status, out = _api(kube, "GET", f"/v1/files/{end['output_file_id']}/content")
    assert status == 200, out[:300]
    results = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    counts = Counter(r["custom_id"] for r in results)
    assert len(results) == BATCH_LINES and set(counts) == {f"line-{i}" for i in range(BATCH_LINES)}, (
        len(results), sorted(set(counts) ^ {f"line-{i}" for i in range(BATCH_LINES)})[:5])
    assert max(counts.values()) == 1, [c for c, n in counts.items() if n > 1][:5]
    bad = [r for r in results if r.get("error") or r["response"]["status_code"] != 200]
    assert not bad, bad[:2]
    # The state was on the claim: the database file is in its folder on this machine.
    claim = next(v.claim for v in restarted.container.volumes if v.claim)
    assert any(kube.claim_dir(claim).glob("*.sqlite3")), sorted(kube.claim_dir(claim).iterdir())
    # What the restarted process did with the lines its predecessor had in flight.
    text = kube.http_get(restarted, {"port": "metrics", "path": "/metrics"})[1]
    after = {r: metric(text, "kvmesh_batch_requests_total", f'result="{r}"') for r in ("ok", "resumed", "rerun")}
    assert after["ok"] > 0, f"the restarted batch pod finished no line: {after}"
    print(f"batch of {BATCH_LINES}: pod killed after {mid['request_counts']['completed']} lines "
          f"({killed_at - t0:.1f} s), ready again {ready:.1f} s later, completed "
          f"{time.monotonic() - killed_at:.1f} s after the kill ({time.monotonic() - t0:.1f} s in all); "
          f"the restarted pod's lines: {after}")


def test_rescheduled_engine_serves_again_and_no_stream_is_lost(kube: Cluster) -> None:
    prompts = _prompts("resched", STREAMS)
    expected = [s.text for s in _complete(kube, prompts, TOKENS)]
    moved: dict[str, Any] = {}

    def reschedule(streams: list[Stream]) -> None:
        old = kube.running[_engine_name(1)]
        new = kube.reschedule(_engine_name(1), "engine1b")
        moved.update(old=old.ip, new=new.ip, pod=new, ready=kube.wait_started(new, RESCHEDULE_BOUND_SECONDS * 4))

    streams = [Stream(p, TOKENS, model=_model(kube)) for p in prompts]
    _streams(kube, streams, during=reschedule)
    _assert_ok(streams, expected)
    new: RunningPod = moved["pod"]
    assert moved["new"] != moved["old"]
    assert moved["ready"] < RESCHEDULE_BOUND_SECONDS, f"ready again only {moved['ready']:.1f} s after its start"
    # Placed on and served: short requests (cold prefixes go to the least
    # loaded engine) until one runs on the moved pod, within the bound.
    _wait_served(kube, new, new.started_at, RESCHEDULE_BOUND_SECONDS, "after")
    print(f"rescheduled {new.pod.name} {moved['old']} -> {moved['new']}: ready {moved['ready']:.1f} s, "
          f"serving {time.monotonic() - new.started_at:.1f} s after its start")


def _keepalive_bound(kube: Cluster) -> float:
    """Seconds after which a silent peer's gRPC stream is given up (the
    ConfigMap's `network`, else the code's defaults)."""
    cm = next(c for c in kube.objects.of("ConfigMap") if "kvmesh.yaml" in (c.get("data") or {}))
    network = yaml.safe_load(cm["data"]["kvmesh.yaml"]).get("network") or {}
    return float(network.get("keepalive_time_seconds", 5.0)) + float(network.get("keepalive_timeout_seconds", 5.0))


def _wait_served(kube: Cluster, r: RunningPod, since: float, bound: float, tag: str) -> float:
    """Short requests until one runs on pod `r`; seconds from `since`, < bound."""
    before, batch = _served(kube, r), 0
    while _served(kube, r) <= before:
        waited = time.monotonic() - since
        served = {n: _served(kube, e) for n, e in kube.running.items() if e.pod.component == "engine"}
        assert waited < bound, f"{r.pod.name} served nothing {waited:.1f} s on (prompt tokens {served})"
        _assert_ok(_complete(kube, _prompts(f"{tag} {batch}", STREAMS), 16))
        batch += 1
    return time.monotonic() - since


def test_engine_of_a_lost_node_rejoins_at_once(kube: Cluster) -> None:
    """Its node drops off the network with the engine running (silence, no
    FIN): the same pod started elsewhere is ready at once, its streams
    complete elsewhere with the text unchanged, and once the lost process's
    keepalive has expired the new one is still registered and placed on (the
    lost one's end must not end the new one's registration: incarnations,
    helper "ident")."""
    prompts = _prompts("lost", STREAMS)
    expected = [s.text for s in _complete(kube, prompts, TOKENS)]
    moved: dict[str, Any] = {}

    def lose(streams: list[Stream]) -> None:
        moved["cut"] = time.monotonic()
        new = kube.reschedule(_engine_name(0), "engine0b", lost=True)
        moved.update(pod=new, ready=kube.wait_started(new, RESCHEDULE_BOUND_SECONDS * 4))

    streams = [Stream(p, TOKENS, model=_model(kube)) for p in prompts]
    _streams(kube, streams, during=lose)
    _assert_ok(streams, expected)
    new: RunningPod = moved["pod"]
    bound = LOST_BOUND_FRACTION * _keepalive_bound(kube)
    registering = new.passed["readinessProbe"] - new.passed.get("startupProbe", 0.0)
    assert registering < bound, (
        f"the replacement of a lost engine was ready only {registering:.1f} s after it had started (bound {bound} s)")
    # The lost process's registration ends (its keepalive expires) -- a protocol timer, so a timed wait.
    time.sleep(max(0.0, moved["cut"] + _keepalive_bound(kube) + 2 - time.monotonic()))
    assert kube.probe(new, new.container.probes["readinessProbe"]), "not ready after the lost one's keepalive"
    serving = _wait_served(kube, new, time.monotonic(), RESCHEDULE_BOUND_SECONDS, "after lost")
    print(f"{new.pod.name} of a lost node: ready {moved['ready']:.1f} s after its start elsewhere "
          f"({registering:.1f} s after started); "
          f"placed on {serving:.1f} s after the lost one's keepalive")


def test_prestop_drains_then_sigterm_ends_the_engine_fast(kube: Cluster) -> None:
    r = kube.running[_engine_name(2)]
    assert r.container.pre_stop, "the engine has no preStop hook"
    prompts = _prompts("prestop", STREAMS)
    expected = [s.text for s in _complete(kube, prompts, TOKENS)]
    hook: dict[str, Any] = {}

    def drain(streams: list[Stream]) -> None:
        text = _engine_metrics(kube, r)
        hook["held"] = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
        t0 = time.monotonic()
        done = kube.exec(r, r.container.pre_stop or [], timeout=r.pod.grace_seconds)
        hook.update(rc=done.returncode, out=done.stdout + done.stderr, seconds=time.monotonic() - t0)
        hook["ready"] = kube.probe(r, r.container.probes["readinessProbe"])
        assert r.proc is not None
        t1 = time.monotonic()
        os.killpg(r.proc.pid, signal.SIGTERM)
        r.proc.wait(timeout=r.pod.grace_seconds)
        hook["exit_seconds"] = time.monotonic() - t1

    streams = [Stream(p, TOKENS, model=_model(kube)) for p in prompts]
    _streams(kube, streams, during=drain)
    print(f"preStop of {r.pod.name}: returned after {hook['seconds']:.1f} s, exit {hook['exit_seconds']:.1f} s "
          f"after SIGTERM")
    assert hook["held"] > 0, f"{r.pod.name} held no stream when preStop ran"
    assert hook["rc"] == 0, hook["out"]
    assert not hook["ready"], "still ready after preStop's drain"
    assert hook["exit_seconds"] < 5, f"SIGTERM after the drain took {hook['exit_seconds']:.1f} s"
    _assert_ok(streams, expected)


# ---------------------------------------------------------------- the shared Redis

REDIS_TURNS = 10
# The conversation's turn after which the gateway that served the last turn
# is SIGKILLed: the next turns must continue, on the other pod, a response
# the dead one stored. They start once Envoy's health checks took the dead
# pod out: in the second before that, Envoy's retries of a refused
# connection went back to the dead pod (3 connection failures, 2 retries,
# the same host each time) and answered 503 -- Envoy's balancing, not the
# store, and not what this test is about.
REDIS_KILL_AFTER = 5


def _responses_served(kube: Cluster, r: RunningPod) -> float:
    """/v1/responses requests gateway pod `r` has finished (0 while it is down)."""
    try:
        text = kube.http_get(r, {"port": "metrics", "path": "/metrics"})[1]
    except Exception:  # noqa: BLE001 - a killed or restarting pod: nothing served yet
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvmesh_gateway_requests_total{") and "responses" in line)


def _envoy_sees_gateways(kube: Cluster, healthy: int) -> bool:
    """Envoy's health checks pass for exactly `healthy` gateway pods in each
    gateway cluster."""
    body = kube.http_get(kube.by_component("envoy")[0], {"port": "metrics", "path": "/stats/prometheus"})[1]
    counts = [float(line.split()[-1]) for line in body.splitlines()
              if line.startswith("envoy_cluster_membership_healthy{") and "gateway_" in line]
    return len(counts) == 2 and all(n == healthy for n in counts)


def _turn(kube: Cluster, turn: int, previous: str | None) -> dict[str, Any]:
    body = {"model": _model(kube), "input": f"Turn {turn}: and what happened next?", "max_output_tokens": 8,
            "store": True, **({"previous_response_id": previous} if previous else {})}
    status, out = _api(kube, "POST", "/v1/responses", json.dumps(body).encode())
    assert status == 200, f"turn {turn} (previous {previous}): {status} {out[:300]!r}"
    return dict(json.loads(out))


def test_a_conversation_continues_across_gateway_pods(kube: Cluster) -> None:
    """Issue 29: behind Envoy's Service, each turn of a Responses
    conversation may land on either gateway pod; with the store in the
    manifests' Redis every turn is 200 -- also the turns after the pod that
    stored their predecessor was SIGKILLed, the first of them sent at once
    (Envoy's retry, not its health check, finds the live gateway)."""
    gateways = sorted(r.pod.name for r in kube.by_component("gateway"))
    assert len(gateways) == 2, gateways
    kube.wait_for(lambda: _envoy_sees_gateways(kube, 2), 30, "Envoy's health checks to pass for both gateways")
    previous: str | None = None
    inputs: list[int] = []
    served_by: list[str] = []
    killed = ""
    for turn in range(REDIS_TURNS):
        if turn == REDIS_KILL_AFTER:
            killed = served_by[-1]
            assert killed in gateways, f"no gateway's count rose for turn {turn - 1}: {served_by}"
            # The next turn at once, before Envoy's health checks see the
            # death: its retry must find the other gateway by itself.
            kube.kill(kube.running[killed])
        before = {n: _responses_served(kube, kube.running[n]) for n in gateways}
        out = _turn(kube, turn, previous)
        after = {n: _responses_served(kube, kube.running[n]) for n in gateways}
        served_by.append(next((n for n in gateways if after[n] > before[n]), "?"))
        previous = str(out["id"])
        inputs.append(int(out["usage"]["input_tokens"]))
    # Every turn carried the whole conversation before it.
    assert inputs == sorted(inputs) and len(set(inputs)) == REDIS_TURNS, inputs
    assert served_by[REDIS_KILL_AFTER] not in (killed, "?"), (killed, served_by)
    kube.wait_for(lambda: _envoy_sees_gateways(kube, 1), 30, f"Envoy to take {killed} out")
    status, body = _api(kube, "GET", f"/v1/responses/{previous}")
    assert status == 200 and json.loads(body)["id"] == previous, (status, body[:300])
    # The conversation is in Redis, under the API key's prefix.
    redis = kube.by_component("redis")[0]
    keys = kube.exec(redis, ["redis-cli", "-p", "6379", "--scan", "--pattern", "kvmesh:resp:*"], timeout=10)
    assert keys.returncode == 0 and any(previous in k for k in keys.stdout.split()), keys.stdout[-300:]
    # The cluster whole again for the tests after this one: kubelet starts the container again.
    ready = kube.wait_started(kube.restart(killed), 60)
    kube.wait_for(lambda: _envoy_sees_gateways(kube, 2), 30, "Envoy to see the restarted gateway healthy")
    print(f"{REDIS_TURNS} turns, each 200, served by {served_by}; {killed} SIGKILLed after turn "
          f"{REDIS_KILL_AFTER - 1}, restarted and ready {ready:.1f} s after the last turn")


def test_only_gateways_and_the_scheduler_reach_redis(kube: Cluster) -> None:
    """The NetworkPolicy kvmesh-redis-from-mesh as nftables: Redis has no
    password, so the policy is its access control. The scheduler keeps its
    incarnation record there (one entry per engine id)."""
    redis = kube.by_component("redis")[0]
    port = resolve_port("redis", redis.container.ports)

    def from_(src: RunningPod) -> str:
        return src.host.call(lambda: connect(redis.ip, port, 1.5), timeout=10)

    for component in ("gateway", "scheduler"):
        assert from_(kube.by_component(component)[0]) == "connected", component
    for component in ("envoy", "engine", "batch"):
        assert from_(kube.by_component(component)[0]) in ("refused", "timeout"), f"{component} reached Redis"
    assert kube.net.hosts["client"].call(lambda: connect(redis.ip, port, 1.5), timeout=10) in ("refused", "timeout")
    ids = kube.exec(redis, ["redis-cli", "-p", "6379", "hkeys", "kvmesh:scheduler:incarnations"], timeout=10)
    engines = {r.pod.name for r in kube.by_component("engine")}
    assert ids.returncode == 0 and set(ids.stdout.split()) == engines, ids.stdout
