"""Fixtures of the namespace tests: skip cleanly without root or `ip netns`;
`netns_mesh`, the whole mesh on seven namespace hosts, once per module, torn
down (every process, namespace and route) however the module ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import netns_unavailable
from .mesh import HOSTS, ROOT, SCHEDULER_HOSTS, NetnsMesh


@pytest.fixture(scope="session")
def netns_ok() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def netns_mesh(netns_ok: None, request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsMesh]:
    """Scheduler, two sim engines, two gateways, Envoy and a client, each on
    its own host. A module may set MESH_TUNE (a function changing the
    MeshConfig before the configs are written) and MESH_SCHEDULERS (active
    scheduler replicas, each on a host of its own; 1 by default)."""
    from .harness import NetnsHarness

    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama is missing: run `make setup`")
    run_dir: Path = tmp_path_factory.mktemp("netns")
    schedulers = getattr(request.module, "MESH_SCHEDULERS", 1)
    with NetnsHarness((*HOSTS, *SCHEDULER_HOSTS[1:schedulers])) as net:
        mesh = NetnsMesh(net, run_dir, getattr(request.module, "MESH_TUNE", None), schedulers)
        mesh.start()
        net.assert_safe()
        yield mesh
        # The test is over: its gateways' drain (3 s not ready, for a load
        # balancer) buys nothing now (tests/_mesh_stop.py).
        for name in [n for n in mesh.procs if n.startswith("gateway-")]:
            mesh.kill(name)
    assert net.leftovers() == [], f"teardown left {net.leftovers()}"
