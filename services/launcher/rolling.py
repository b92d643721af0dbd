"""A rolling restart of one role's children (the gateways behind Envoy, or
the scheduler replicas), one at a time, so the mesh never serves with fewer
than all-but-one of them:

    for each child: SIGTERM (a gateway drains: not ready, Envoy takes it out,
    its streams finish; a scheduler replica hands its queued requests over)
    -> wait for its exit (its spec's stop_grace, then SIGKILL) -> start it
    again and wait until its own probes pass -> wait until it is in rotation
    again (a gateway: Envoy's health checks mark it healthy; a scheduler:
    every running engine reports to it, `Mesh.in_rotation`) -> the next one.

`Mesh.rolling_restart` wires it to the mesh; `kvmesh up` runs it on SIGUSR1
(gateways). Driven from the supervisor's one thread, like everything else there.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.edge.fragments import GRPC_CLUSTER, HTTP_CLUSTER
from services.launcher.children import MeshError

__all__ = ["RollStep", "envoy_healthy", "roll"]

log = logging.getLogger("kvmesh.launcher")

# Envoy checks every second (edge topology); a restarted gateway is back in
# rotation after one passed check, far within this.
_IN_ROTATION_TIMEOUT_SECONDS = 60.0
_POLL_SECONDS = 0.1


class _Rollable(Protocol):
    def terminate(self, name: str) -> None: ...
    def wait(self, name: str, timeout: float) -> int | None: ...
    def kill(self, name: str) -> None: ...
    def restart(self, name: str) -> None: ...
    def stop_grace(self, name: str) -> float: ...


@dataclass(frozen=True)
class RollStep:
    name: str
    # The old process's exit code (None: it outlived its stop grace and was killed).
    exit_code: int | None
    # SIGTERM -> its replacement in rotation.
    seconds: float


def roll(
    children: _Rollable, names: list[str], in_rotation: Callable[[str], bool], cancel: threading.Event,
) -> list[RollStep]:
    """Restart `names` one after the other (module docstring); raises
    MeshError if a replacement does not come back into rotation."""
    steps: list[RollStep] = []
    for name in names:
        began = time.monotonic()
        log.info("rolling restart: stopping %s (it drains)", name)
        children.terminate(name)
        code = children.wait(name, children.stop_grace(name))
        if code is None:
            log.warning("rolling restart: %s still running after its stop grace; killing it", name)
            children.kill(name)
        children.restart(name)
        deadline = time.monotonic() + _IN_ROTATION_TIMEOUT_SECONDS
        while not in_rotation(name):
            if time.monotonic() > deadline:
                raise MeshError(f"rolling restart: {name} restarted but was not back in rotation (a gateway: "
                                f"healthy in Envoy; a scheduler: every engine reporting to it) within "
                                f"{_IN_ROTATION_TIMEOUT_SECONDS:.0f} s")
            if cancel.wait(_POLL_SECONDS):
                raise MeshError(f"rolling restart interrupted after restarting {name}")
        steps.append(RollStep(name, code, time.monotonic() - began))
        log.info("rolling restart: %s back in rotation after %.1f s (old one exited with %s)",
                 name, steps[-1].seconds, code)
    return steps


def envoy_healthy(admin_port: int, http_endpoint: str, grpc_endpoint: str) -> bool:
    """Does the Envoy with this admin port route to the gateway at these
    host:port endpoints -- healthy in both gateway clusters?"""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters", timeout=2.0) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return False
    wanted = {f"{HTTP_CLUSTER}::{http_endpoint}::health_flags::healthy",
              f"{GRPC_CLUSTER}::{grpc_endpoint}::health_flags::healthy"}
    return wanted <= {line.strip() for line in text.splitlines()}
