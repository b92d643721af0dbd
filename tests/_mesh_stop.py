"""How a test's mesh ends: its gateways and batch service at once, then the
rest as `kvmesh` stops a mesh.

A gateway given SIGTERM stays up `gateway.drain_unready_seconds` (3 s by
default) while a load balancer notices it is not ready, before it drains:
three seconds of every mesh's teardown in which nothing happens -- the
test is over, nothing is in flight, and Envoy stops with the mesh. SIGKILL
(the process group, as `Mesh.kill`) skips that wait. The graceful drain
itself keeps its tests (test_e2e_gateway_roll.py, test_e2e_gateway_drain_cut.py,
test_e2e_probes.py, tests/integration/test_pod_processes.py). The batch
service would give lines still in flight `batch.drain_seconds`; its drain
and restart have their own tests (tests/unit/batch/test_batch_service.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.launcher.mesh import Mesh

__all__ = ["stop_test_mesh"]


def stop_test_mesh(mesh: Mesh) -> None:
    for name in mesh.names:
        if (name.startswith("gateway-") or name == "batch") and mesh.is_running(name):
            mesh.kill(name)
    mesh.stop_all()
