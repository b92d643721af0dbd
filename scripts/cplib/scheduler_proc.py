"""The scheduler process under test, started the way `kvmesh up` starts it:
the launcher's own child spec (services/launcher/specs.py: `python -m
services.cli --config <resolved config> --log-level <level> scheduler`, the
launcher's child environment), over a resolved config written as the
launcher writes it (services/launcher/mesh.py), with free ports and its log
in the run directory; ready when its gRPC health check says SERVING."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from services.common.config import MeshConfig, load_config
from services.launcher.children import Role
from services.launcher.options import Endpoints, MeshOptions, RunFiles
from services.launcher.ports import free_port
from services.launcher.probes import probe_ok
from services.launcher.specs import child_specs

__all__ = ["SchedulerProcess", "start_scheduler"]

_START_SECONDS = 60.0


@dataclass
class SchedulerProcess:
    process: subprocess.Popen[bytes]
    address: str
    metrics_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10.0) as resp:
            return str(resp.read().decode())

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _resolved(config_path: str, run_dir: Path) -> tuple[MeshConfig, RunFiles]:
    cfg = load_config(config_path)
    cfg.run_dir = str(run_dir)
    cfg.scheduler.port = free_port()
    cfg.scheduler.metrics_port = free_port()
    cfg.gateway.scheduler_address = f"127.0.0.1:{cfg.scheduler.port}"
    files = RunFiles(run_dir)
    files.log_dir.mkdir(parents=True, exist_ok=True)
    files.config_path.write_text("# Written by scripts/bench_control_plane.py, as kvmesh up writes it.\n"
                                 + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    return cfg, files


def start_scheduler(config_path: str, run_dir: Path, log_level: str = "INFO") -> SchedulerProcess:
    """Start the scheduler and wait until it serves."""
    cfg, files = _resolved(config_path, run_dir)
    endpoints = Endpoints(0, 0, cfg.gateway.scheduler_address, [], [], [])
    options = MeshOptions(gateways=0, envoy=False, run_dir=run_dir)
    spec = next(s for s in child_specs(cfg, options, files, endpoints) if s.role is Role.SCHEDULER)
    argv = list(spec.argv)
    argv[argv.index("--log-level") + 1] = log_level   # the launcher's is $KVMESH_LOG_LEVEL, else INFO
    log_path = files.log_dir / "scheduler.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=str(Path(__file__).resolve().parents[2]))
    started = SchedulerProcess(process, cfg.gateway.scheduler_address,
                               f"http://127.0.0.1:{cfg.scheduler.metrics_port}/metrics", log_path)
    channels: dict[str, grpc.Channel] = {}
    try:
        deadline = time.monotonic() + _START_SECONDS
        while not probe_ok(spec.probes[0], channels):
            if process.poll() is not None or time.monotonic() > deadline:
                started.stop()
                raise RuntimeError(f"the scheduler did not start; see {log_path}")
            time.sleep(0.2)
    finally:
        for channel in channels.values():
            channel.close()
    return started
