"""Each service started the way a Kubernetes pod starts it -- `kvmesh
scheduler`, `kvmesh gateway --replica 0`, `kvmesh engine --engine-id POD
--advertise-address NAME:PORT` -- from one kvmesh.yaml as the ConfigMap holds
it: wildcard binds ("::", "0.0.0.0"), the scheduler by DNS name, mesh TLS
on, API keys from a mounted file. Real processes on loopback: every probe
answers on the metrics port over plain HTTP, the engine registers under its
pod name with the advertised DNS name, a chat request is served through it,
`kvmesh drain` drains the engine (the preStop hook) and SIGTERM then ends
every process at once."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.common.mesh_tls import MeshIdentity, sync_channel
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher.ports import PortAllocator
from services.tools.devcerts import ensure_mesh_certs

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
API_KEY = "pod-test-key"
POD = "kvmesh-engine-0"
WAIT_SECONDS = 90.0


@dataclass
class Ports:
    scheduler: int
    scheduler_metrics: int
    http: int
    grpc: int
    gateway_metrics: int
    engine: int
    engine_metrics: int


@dataclass
class Pods:
    ports: Ports
    tls: Path
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]


def _config(tmp: Path, ports: Ports, tls: Path) -> Path:
    keys = tmp / "api-keys.yaml"
    keys.write_text(yaml.safe_dump({"api_keys": [
        {"sha256": hashlib.sha256(API_KEY.encode()).hexdigest(), "tenant": "pods"}]}))
    scheduler = f"localhost:{ports.scheduler}"  # a DNS name, as kvmesh-scheduler:50051 is
    data = {
        "run_dir": str(tmp / "run"),
        "models": [{"name": MODEL, "path": str(ROOT / ".models" / MODEL)}],
        "mesh_tls": {"enabled": True, "cert_dir": str(tls)},
        "scheduler": {"host": "::", "port": ports.scheduler, "metrics_port": ports.scheduler_metrics},
        "gateway": {"host": "0.0.0.0", "http_port": ports.http, "grpc_port": ports.grpc,
                    "metrics_port": ports.gateway_metrics, "scheduler_address": scheduler,
                    "api_keys_file": str(keys), "drain_seconds": 5, "drain_unready_seconds": 0},
        "engines": {"backend": "sim", "base_port": ports.engine, "metrics_base_port": ports.engine_metrics,
                    "template": {"host": "::", "scheduler_address": scheduler, "stop_grace_seconds": 2}},
    }
    path = tmp / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _probe(port: int, name: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/{name}", timeout=10) as response:
            return response.status, json.loads(response.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["status"]


def _wait_ready(pods: Pods, name: str, port: int) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if pods.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited ({pods.procs[name].returncode}):\n{pods.log(name)}")
        try:
            if _probe(port, "ready")[0] == 200:
                return
        except (OSError, ValueError):
            pass  # not listening yet
        time.sleep(0.1)
    raise AssertionError(f"{name} not ready within {WAIT_SECONDS} s:\n{pods.log(name)}")


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Pods]:
    if not (ROOT / ".models" / MODEL).is_dir():
        pytest.skip(f".models/{MODEL} is missing: run `make setup`")
    alloc = PortAllocator()
    ports = Ports(*(alloc.one() for _ in range(7)))
    tls = ensure_mesh_certs(tmp_path / "tls")
    config = _config(tmp_path, ports, tls)
    logs = tmp_path / "logs"
    logs.mkdir()
    argv = {
        "scheduler": ["scheduler"],
        "gateway": ["gateway", "--replica", "0"],
        "engine": ["engine", "--engine-id", POD, "--advertise-address", f"localhost:{ports.engine}"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in argv.items():
            with (logs / f"{name}.log").open("wb") as out:
                procs[name] = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(config), *args],
                                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        yield Pods(ports, tls, procs, logs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _chat(pods: Pods) -> dict[str, object]:
    """A chat completion on the gateway's API port, TLS with Envoy's certificate."""
    context = MeshIdentity.load(pods.tls, "envoy").client_ssl_context()
    context.check_hostname = False  # the gateway's certificate names gateway.kvmesh.internal
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello pods"}], "max_tokens": 8}
    request = urllib.request.Request(
        f"https://127.0.0.1:{pods.ports.http}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60, context=context) as response:
        result: dict[str, object] = json.loads(response.read())
        return result


def test_services_started_as_pods_probe_serve_drain_and_stop(pods: Pods) -> None:
    p = pods.ports
    metrics = {"scheduler": p.scheduler_metrics, "gateway": p.gateway_metrics, "engine": p.engine_metrics}
    for name, port in metrics.items():
        _wait_ready(pods, name, port)
        assert {n: _probe(port, n) for n in ("started", "ready", "live")} == {
            "started": (200, "ok"), "ready": (200, "ok"), "live": (200, "ok")}, name

    admin = MeshIdentity.load(pods.tls, "admin")
    with sync_channel(f"localhost:{p.scheduler}", admin, "scheduler") as channel:
        state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=10)
    engines = {e.engine_id: e.address for e in state.engines}
    assert engines == {POD: f"localhost:{p.engine}"}

    answer = _chat(pods)
    assert answer["choices"][0]["message"]["content"]

    drain = subprocess.run([sys.executable, "-m", "services.cli", "drain", "--port", str(p.engine_metrics)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    assert json.loads(drain.stdout.split("kvmesh drain: ", 1)[1])["status"] == "drained"
    assert _probe(p.engine_metrics, "ready") == (503, "draining")
    assert _probe(p.engine_metrics, "live") == (200, "ok")
    assert pods.procs["engine"].poll() is None  # drained, still up until SIGTERM

    for name in ("engine", "gateway", "scheduler"):
        began = time.monotonic()
        pods.procs[name].terminate()
        assert pods.procs[name].wait(30) == 0, pods.log(name)
        assert time.monotonic() - began < 10, f"{name} took long to stop after SIGTERM"
