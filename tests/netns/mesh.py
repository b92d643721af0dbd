"""The real mesh on namespace hosts: scheduler, two sim engines, two
gateways and Envoy, each its own host (harness.py), plus a client host.

Every service is the same `python -m services.cli ...` command `kvmesh up`
runs, started with `ip netns exec` on its host, from a YAML config written
for that host (its own address as its bind host, the others' addresses as
its peers). Envoy's bootstrap comes from `kvmesh envoy render` over a
topology naming the gateways' host addresses. Every config, and the
rendered bootstrap, passes the harness's address check (rule (c)) before
anything starts. Probes reach each service over the network of a host
(`Host.call`): the client host for the public path, a service's own host
for its metrics (so an engine is observable while it is cut off).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from services.common.config import ApiKeyConfig, MeshConfig, load_config
from services.edge.render import GRPC_CLUSTER, HTTP_CLUSTER
from services.edge.topology import TimeoutSpec
from services.launcher.envoy_config import envoy_binary

from .harness import Host, NetnsHarness

__all__ = ["HOSTS", "MODEL", "SCHEDULER_HOSTS", "NetnsMesh", "ServiceFailed", "metric"]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("sched", "gw0", "gw1", "eng0", "eng1", "envoy", "client")
# Scheduler replicas' hosts (`NetnsMesh(schedulers=N)`): the first is HOSTS's.
SCHEDULER_HOSTS = ("sched", "sched1", "sched2")
GATEWAYS = ("gw0", "gw1")
ENGINES = ("eng0", "eng1")
MODEL = "tiny-llama"
API_KEY = "kvm14-netns-test-key"
START_TIMEOUT = 90.0
# Fixed ports: each service has a host of its own, so nothing collides.
SCHEDULER_PORT, SCHEDULER_METRICS = 50051, 9101
ENGINE_PORT, ENGINE_METRICS = 50100, 9200
GATEWAY_HTTP, GATEWAY_GRPC, GATEWAY_METRICS = 8000, 50061, 9102
ENVOY_PORT, ENVOY_ADMIN = 8080, 9901


class ServiceFailed(RuntimeError):
    """A service did not come up (its log's tail is in the message)."""


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of Prometheus samples `name{...labels...}` in `text` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _http_get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


class NetnsMesh:
    """Start with `start()`; the harness's teardown stops every process."""

    def __init__(self, net: NetnsHarness, run_dir: Path, tune: Callable[[MeshConfig], None] | None = None,
                 schedulers: int = 1) -> None:
        """`schedulers` > 1: that many active replicas, on SCHEDULER_HOSTS
        (the harness must have made those hosts), as `kvmesh up --schedulers N`."""
        self.net = net
        self.run_dir = run_dir
        self.addr = net.addresses
        self.scheduler_hosts = SCHEDULER_HOSTS[:schedulers]
        self.config = self._base_config(tune)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, tuple[str, list[str]]] = {}  # name -> (host, argv), for restart
        self.logs: dict[str, Path] = {}

    # ------------------------------------------------------------ configs

    def _base_config(self, tune: Callable[[MeshConfig], None] | None) -> MeshConfig:
        a = self.addr
        config = load_config(ROOT / "config" / "kvmesh.yaml")
        config.run_dir = str(self.run_dir)
        config.scheduler.host, config.scheduler.port = a["sched"], SCHEDULER_PORT
        config.scheduler.metrics_port = SCHEDULER_METRICS
        scheduler = f"{a['sched']}:{SCHEDULER_PORT}"
        config.engines.count, config.engines.backend = len(ENGINES), "sim"
        config.engines.base_port, config.engines.metrics_base_port = ENGINE_PORT, ENGINE_METRICS
        config.engines.template.host, config.engines.template.model = a["eng0"], MODEL
        config.engines.template.scheduler_address = scheduler
        gw = config.gateway
        gw.host, gw.scheduler_address = a["gw0"], scheduler
        gw.http_port, gw.grpc_port, gw.metrics_port = GATEWAY_HTTP, GATEWAY_GRPC, GATEWAY_METRICS
        gw.api_keys = [ApiKeyConfig(sha256=hashlib.sha256(API_KEY.encode()).hexdigest(), tenant="netns")]
        if len(self.scheduler_hosts) > 1:
            replicas = [f"{a[h]}:{SCHEDULER_PORT}" for h in self.scheduler_hosts]
            gw.scheduler_addresses = list(replicas)
            config.engines.template.scheduler_addresses = list(replicas)
            config.scheduler.peers.addresses = list(replicas)
        config.envoy.listen_host, config.envoy.port, config.envoy.admin_port = a["envoy"], ENVOY_PORT, ENVOY_ADMIN
        if tune is not None:
            tune(config)
        return config

    def _write_config(self, host: str) -> Path:
        """The mesh config as `host` reads it: its own address as bind host."""
        config = dataclasses.replace(self.config)
        config.gateway = dataclasses.replace(self.config.gateway)
        config.engines = dataclasses.replace(self.config.engines)
        config.engines.template = dataclasses.replace(self.config.engines.template)
        if host in GATEWAYS:
            config.gateway.host = self.addr[host]
        if host in ENGINES:
            config.engines.template.host = self.addr[host]
        if host in SCHEDULER_HOSTS:
            config.scheduler = dataclasses.replace(self.config.scheduler, host=self.addr[host])
        data = dataclasses.asdict(config)
        self.net.check_addresses(data, f"{host}'s config")
        path = self.run_dir / f"{host}.yaml"
        path.write_text(f"# kvmesh config of netns host {host} ({self.addr[host]})\n"
                        + yaml.safe_dump(data, sort_keys=False))
        return path

    def _render_envoy(self) -> Path:
        """Envoy's bootstrap from `kvmesh envoy render`, over a topology with
        the gateways' host addresses and fast health checks."""
        timeouts: dict[str, Any] = {"connect_seconds": 1}
        names = {f.name for f in dataclasses.fields(TimeoutSpec)}
        keepalive = getattr(self.config, "network", None)
        if keepalive is not None and "upstream_keepalive_seconds" in names:  # helper "fence"'s settings
            timeouts["upstream_keepalive_seconds"] = keepalive.keepalive_time_seconds
            timeouts["upstream_keepalive_timeout_seconds"] = keepalive.keepalive_timeout_seconds
        topology = {
            "listener": {"host": self.addr["envoy"], "port": ENVOY_PORT},
            "admin": {"host": "127.0.0.1", "port": ENVOY_ADMIN},
            "gateways": [{"host": self.addr[g], "http_port": GATEWAY_HTTP, "grpc_port": GATEWAY_GRPC}
                         for g in GATEWAYS],
            "timeouts": timeouts,
            "health_check": {"interval_seconds": 1, "timeout_seconds": 1, "unhealthy_threshold": 2,
                             "healthy_threshold": 1},
            "transcoder": {"descriptor": str(ROOT / "envoy" / "kvmesh.pb")},
            "web": {"root": str(ROOT / "web")},
        }
        self.net.check_addresses(topology, "Envoy's topology")
        source, out = self.run_dir / "topology.yaml", self.run_dir / "envoy.yaml"
        source.write_text(yaml.safe_dump(topology, sort_keys=False))
        proc = subprocess.run([sys.executable, "-m", "services.cli", "envoy", "render", "--topology", str(source),
                               "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise ServiceFailed(f"kvmesh envoy render failed: {proc.stderr.strip()}")
        self.net.check_addresses(yaml.safe_load(out.read_text()), "Envoy's rendered bootstrap")
        return out

    # ------------------------------------------------------------ processes

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("KVMESH_CONFIG", None)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        return env

    def _spawn(self, name: str, host: str, argv: list[str]) -> None:
        self.commands[name] = (host, argv)
        self.logs[name] = self.run_dir / f"{name}.log"
        with self.logs[name].open("ab") as log:
            self.procs[name] = self.net.hosts[host].spawn(argv, log, env=self._env(), cwd=ROOT)

    def _kvmesh(self, host: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "services.cli", "--config", str(self._write_config(host)),
                "--log-level", os.environ.get("KVMESH_LOG_LEVEL", "INFO"), *args]

    def start(self) -> None:
        """Scheduler, then engines and gateways, then Envoy; each waited for
        (bounded). Raises ServiceFailed naming the one that did not come up."""
        for name, host in self.schedulers():
            self._spawn(name, host, self._kvmesh(host, "scheduler"))
        for name, host in self.schedulers():
            self._wait(name, host, f"http://{self.addr[host]}:{SCHEDULER_METRICS}/metrics")
        for i, host in enumerate(ENGINES):
            self._spawn(f"engine-{i}", host, self._kvmesh(host, "engine", "--index", str(i)))
        for r, host in enumerate(GATEWAYS):
            self._spawn(f"gateway-{r}", host, self._kvmesh(host, "gateway", "--replica", str(r)))
        for i, host in enumerate(ENGINES):
            self._wait(f"engine-{i}", host, f"http://{self.addr[host]}:{ENGINE_METRICS + i}/metrics")
        for r, host in enumerate(GATEWAYS):
            self._wait(f"gateway-{r}", "client", f"http://{self.addr[host]}:{GATEWAY_HTTP}/health")
        bootstrap = self._render_envoy()
        self._spawn("envoy", "envoy", [envoy_binary(), "-c", str(bootstrap), "--use-dynamic-base-id",
                                       "--log-level", "warning"])
        self._wait("envoy", "envoy", f"http://127.0.0.1:{ENVOY_ADMIN}/ready")
        self._wait("envoy", "client", f"{self.public_http}/healthz")
        self.wait_for(lambda: all(self.fresh_engines(h) == len(ENGINES) for _, h in self.schedulers()),
                      START_TIMEOUT, "both engines registered with every scheduler")
        self.wait_for(lambda: all(self.envoy_healthy(g) for g in GATEWAYS), START_TIMEOUT,
                      "Envoy to see both gateways healthy")

    def schedulers(self) -> list[tuple[str, str]]:
        """(name, host) of each scheduler replica: "scheduler", "scheduler-1", ..."""
        return [("scheduler" if i == 0 else f"scheduler-{i}", host) for i, host in enumerate(self.scheduler_hosts)]

    def _wait(self, name: str, host: str, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise ServiceFailed(f"{name} exited with {self.procs[name].returncode}:\n{self.log_tail(name)}")
            try:
                if self.get(host, url, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise ServiceFailed(f"{name} not up at {url} after {START_TIMEOUT} s:\n{self.log_tail(name)}")

    def kill(self, name: str) -> None:
        """SIGKILL service `name` (its process group: `ip netns exec` execs the service)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start service `name` again, as it was started (a new process on its
        host, stopped by the harness's teardown like the first), and wait
        until it answers. An engine or the scheduler also restarts this way
        after it exited on its own (what `kvmesh up` does)."""
        host, argv = self.commands[name]
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._spawn(name, host, argv)
        self._wait(name, *self._probe(name))

    def _probe(self, name: str) -> tuple[str, str]:
        """(host to probe from, url) that answers 200 once `name` is up."""
        host = self.commands[name][0]
        if name == "scheduler" or name.startswith("scheduler-"):
            return host, f"http://{self.addr[host]}:{SCHEDULER_METRICS}/metrics"
        if name.startswith("engine-"):
            return host, f"http://{self.addr[host]}:{ENGINE_METRICS + int(name[7:])}/metrics"
        if name.startswith("gateway-"):
            return "client", f"http://{self.addr[host]}:{GATEWAY_HTTP}/health"
        raise ValueError(f"cannot restart {name}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs.get(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path and path.exists() else ""

    def exited(self) -> dict[str, int]:
        """Services that have exited, with their codes."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    # ------------------------------------------------------------ probes

    @property
    def public_http(self) -> str:
        return f"http://{self.addr['envoy']}:{ENVOY_PORT}"

    @property
    def client(self) -> Host:
        return self.net.hosts["client"]

    def get(self, host: str, url: str, timeout: float = 3.0) -> tuple[int, str]:
        """GET url from `host`'s network: (status, body)."""
        return self.net.hosts[host].call(lambda: _http_get(url, timeout), timeout=timeout + 5)

    def engine_metrics(self, index: int) -> str:
        """Engine `index`'s /metrics, read on its own host (works while it is cut off)."""
        host = ENGINES[index]
        return self.get(host, f"http://{self.addr[host]}:{ENGINE_METRICS + index}/metrics")[1]

    def engine_live(self, index: int) -> int:
        """Generations engine `index` holds: running + waiting."""
        text = self.engine_metrics(index)
        return int(metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting"))

    def set_sim_speed(self, factor: float | None) -> None:
        """Every engine's run-time speed (POST /sim/speed?factor=F; None:
        DELETE, back to its schedule), set on its own host."""
        for index, host in enumerate(ENGINES):
            url = f"http://{self.addr[host]}:{ENGINE_METRICS + index}/sim/speed"
            request = urllib.request.Request(url + ("" if factor is None else f"?factor={factor}"),
                                             method="DELETE" if factor is None else "POST")

            def send(request: urllib.request.Request = request) -> int:
                with urllib.request.urlopen(request, timeout=10) as resp:
                    return int(resp.status)
            assert self.net.hosts[host].call(send, timeout=15) == 200, f"{url}: speed not set"

    def scheduler_metrics(self, host: str = "sched") -> str:
        """A scheduler replica's /metrics, read on its own host (works while it is cut off)."""
        return self.get(host, f"http://{self.addr[host]}:{SCHEDULER_METRICS}/metrics")[1]

    def fresh_engines(self, host: str = "sched") -> int:
        return int(metric(self.scheduler_metrics(host), "kvmesh_scheduler_engines", 'state="fresh"'))

    def gateway_counter(self, replica: int, name: str) -> float:
        host = GATEWAYS[replica]
        return metric(self.get("client", f"http://{self.addr[host]}:{GATEWAY_METRICS}/metrics")[1], name)

    def envoy_flags(self, gateway: str) -> dict[str, str]:
        """Envoy's view (admin /clusters) of `gateway`: health flags per cluster."""
        text = self.get("envoy", f"http://127.0.0.1:{ENVOY_ADMIN}/clusters")[1]
        address = re.escape(self.addr[gateway])
        found = re.findall(rf"^({GRPC_CLUSTER}|{HTTP_CLUSTER})::{address}:\d+::health_flags::(\S+)$", text, re.M)
        return dict(found)

    def envoy_healthy(self, gateway: str) -> bool:
        """Both of Envoy's clusters send to `gateway`."""
        flags = self.envoy_flags(gateway)
        return len(flags) == 2 and all(f == "healthy" for f in flags.values())

    def envoy_dropped(self, gateway: str) -> bool:
        """Neither of Envoy's clusters sends to `gateway` (each checks it on its own)."""
        flags = self.envoy_flags(gateway)
        return len(flags) == 2 and all(f != "healthy" for f in flags.values())

    @staticmethod
    def wait_for(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> float:
        """Poll until predicate() (errors count as false); seconds waited."""
        start = time.monotonic()
        while True:
            try:
                if predicate():
                    return time.monotonic() - start
            except OSError:
                pass
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(poll)

