"""A real Prometheus for a local mesh: Debian's `prometheus` binary on a free
loopback port, its data in a folder of the caller's, scraping the mesh's
metrics ports and Envoy's admin `/stats/prometheus` every second, with the
rule files given. The tests and `kvmesh dashboards demo` use it.

Job names are those a Prometheus Operator gives the overlay's monitors
(kvmesh-scheduler, kvmesh-gateway, kvmesh-engine), so the alert rules'
`job=~` matchers read local and cluster series alike. The process is ended by
its PID, always (`stop`, or leaving the `with` block).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import yaml

from services.launcher.ports import free_port
from services.observability.prom_api import PromError, api

if TYPE_CHECKING:
    from services.launcher.mesh import Mesh

__all__ = ["LocalPrometheus", "ScrapeTarget", "mesh_targets"]

PROMETHEUS = "/usr/bin/prometheus"


@dataclass(frozen=True)
class ScrapeTarget:
    job: str
    address: str  # host:port
    path: str = "/metrics"


def mesh_targets(mesh: Mesh) -> list[ScrapeTarget]:
    """Every metrics port of a started mesh, and its Envoy's admin port
    (when it runs Envoy)."""
    config, endpoints = mesh.config, mesh.endpoints
    gateways = len(endpoints.gateway_http)
    targets = [ScrapeTarget("kvmesh-scheduler", f"127.0.0.1:{config.scheduler.metrics_port}")]
    targets += [ScrapeTarget("kvmesh-gateway", f"127.0.0.1:{config.gateway.metrics_port + r}") for r in range(gateways)]
    targets += [ScrapeTarget("kvmesh-engine", f"127.0.0.1:{config.engine_config(i).metrics_port}")
                for i in range(len(endpoints.engines))]
    if endpoints.admin_port:
        targets.append(ScrapeTarget("kvmesh-envoy", f"127.0.0.1:{endpoints.admin_port}", "/stats/prometheus"))
    return targets


class LocalPrometheus:
    """`start()` returns once Prometheus answers /-/ready; `url` is its base."""

    def __init__(self, targets: list[ScrapeTarget], rule_files: list[Path], data_dir: Path,
                 interval: str = "1s", binary: str = PROMETHEUS) -> None:
        self.targets, self.rule_files, self.data_dir = targets, rule_files, data_dir
        self.interval, self.binary = interval, binary
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available(binary: str = PROMETHEUS) -> bool:
        return Path(binary).is_file() or shutil.which(binary) is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "prometheus.log"

    def config(self) -> dict[str, object]:
        jobs: dict[tuple[str, str], list[str]] = {}
        for t in self.targets:
            jobs.setdefault((t.job, t.path), []).append(t.address)
        return {
            "global": {"scrape_interval": self.interval, "scrape_timeout": self.interval,
                       "evaluation_interval": self.interval},
            "rule_files": [str(p.resolve()) for p in self.rule_files],
            "scrape_configs": [{"job_name": job, "metrics_path": path, "static_configs": [{"targets": addresses}]}
                               for (job, path), addresses in jobs.items()],
        }

    def start(self, timeout: float = 60.0) -> LocalPrometheus:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.data_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.port = free_port()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise PromError(f"prometheus exited {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise PromError(f"prometheus not ready after {timeout:.0f} s: {self.log_tail()}")

    def wait_all_up(self, timeout: float = 60.0) -> None:
        """Until every target was scraped and is up."""
        deadline = time.monotonic() + timeout
        bad: list[str] = ["(no answer)"]
        while time.monotonic() < deadline:
            active = api(self.url, "targets", {"state": "active"})["activeTargets"]
            bad = [f"{t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}"
                   for t in active if t["health"] != "up"]
            if len(active) == len(self.targets) and not bad:
                return
            time.sleep(0.5)
        raise PromError(f"targets not up after {timeout:.0f} s: {bad}")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL after 10 s; safe to call twice."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
