"""The scheduler processes under test, started the way `kvmesh up
--schedulers N` starts them: the launcher's own child specs
(services/launcher/specs.py: `python -m services.cli --config <resolved
config> --log-level <level> scheduler --port P --metrics-port M`, the
launcher's child environment), replica r on scheduler.port + r and
scheduler.metrics_port - r (services/launcher/port_plan.py) from free port
blocks, over a resolved config written as the launcher writes it
(services/launcher/mesh.py), each replica's log in the run directory; ready
when every replica's gRPC health check says SERVING."""

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
from services.launcher.children import ChildSpec, Role
from services.launcher.options import Endpoints, MeshOptions, RunFiles
from services.launcher.port_plan import scheduler_addresses, scheduler_ports
from services.launcher.ports import PortAllocator
from services.launcher.probes import probe_ok
from services.launcher.specs import child_specs

__all__ = ["SchedulerProcess", "start_scheduler", "start_schedulers", "stop_all"]

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

    def signal_stop(self) -> None:
        """SIGTERM (a graceful stop) if still running."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 10 s."""
        self.signal_stop()
        if self.process.poll() is None:
            try:
                self.process.wait(10.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def stop_all(schedulers: list[SchedulerProcess]) -> None:
    """Every replica told to stop at once, then each waited for (SIGKILL
    after 10 s): replicas stop side by side, as `kvmesh down` stops them."""
    for sched in schedulers:
        sched.signal_stop()
    for sched in schedulers:
        sched.stop()


def _resolved(config_path: str, run_dir: Path, replicas: int) -> tuple[MeshConfig, RunFiles]:
    cfg = load_config(config_path)
    cfg.run_dir = str(run_dir)
    ports = PortAllocator()
    cfg.scheduler.port = ports.block(replicas)
    cfg.scheduler.metrics_port = ports.block(replicas) + replicas - 1   # replica r: metrics_port - r
    addresses = scheduler_addresses(cfg, replicas)
    cfg.gateway.scheduler_address = addresses[0]
    cfg.gateway.scheduler_addresses = addresses if replicas > 1 else []
    files = RunFiles(run_dir)
    files.log_dir.mkdir(parents=True, exist_ok=True)
    files.config_path.write_text("# Written by scripts/bench_control_plane.py, as kvmesh up writes it.\n"
                                 + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    return cfg, files


def _launch(spec: ChildSpec, address: str, metrics_port: int, log_level: str, log_path: Path) -> SchedulerProcess:
    argv = list(spec.argv)
    argv[argv.index("--log-level") + 1] = log_level   # the launcher's is $KVMESH_LOG_LEVEL, else INFO
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=str(Path(__file__).resolve().parents[2]))
    return SchedulerProcess(process, address, f"http://127.0.0.1:{metrics_port}/metrics", log_path)


def _wait_serving(specs: list[ChildSpec], started: list[SchedulerProcess]) -> None:
    channels: dict[str, grpc.Channel] = {}
    try:
        deadline = time.monotonic() + _START_SECONDS
        for spec, sched in zip(specs, started, strict=True):
            while not probe_ok(spec.probes[0], channels):
                if sched.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the scheduler did not start; see {sched.log_path}")
                time.sleep(0.2)
    finally:
        for channel in channels.values():
            channel.close()


def start_schedulers(config_path: str, run_dir: Path, log_level: str = "INFO",
                     replicas: int = 1) -> list[SchedulerProcess]:
    """Start `replicas` scheduler processes side by side and wait until each serves."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    cfg, files = _resolved(config_path, run_dir, replicas)
    addresses = scheduler_addresses(cfg, replicas)
    endpoints = Endpoints(0, 0, addresses[0], [], [], [], schedulers=addresses)
    options = MeshOptions(gateways=0, envoy=False, run_dir=run_dir, schedulers=replicas)
    specs = [s for s in child_specs(cfg, options, files, endpoints) if s.role is Role.SCHEDULER]
    started: list[SchedulerProcess] = []
    try:
        for r, spec in enumerate(specs):
            log_path = files.log_dir / f"{spec.name}.log"
            started.append(_launch(spec, addresses[r], scheduler_ports(cfg, r)[1], log_level, log_path))
        _wait_serving(specs, started)
    except BaseException:
        stop_all(started)
        raise
    return started


def start_scheduler(config_path: str, run_dir: Path, log_level: str = "INFO") -> SchedulerProcess:
    """Start one scheduler and wait until it serves."""
    return start_schedulers(config_path, run_dir, log_level)[0]
