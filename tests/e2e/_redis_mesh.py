"""A sim mesh whose gateways share one real redis-server (the response
cache's and the Responses store's e2e tests): scheduler, two sim engines,
two gateways and Envoy, with `gateway.response_cache` pointing at Redis.
Its own mesh, not the shared e2e_mesh: the Redis URL is in the config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.common.config import MeshConfig
from services.common.config.response_cache import ResponseCacheConfig
from services.launcher.mesh import Mesh

__all__ = ["redis_mesh"]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"


@contextmanager
def redis_mesh(redis_url: str, run_dir: Path, tune: Callable[[MeshConfig], None],
               cache: bool = True) -> Iterator[Mesh]:
    """The mesh, `tune` applied to its config after the Redis settings;
    `cache` false = Redis configured, the response cache itself off."""
    from services.common.config import load_config
    from services.launcher.mesh import MeshOptions, start_on_free_ports

    if not (ROOT / ".models" / MODEL).is_dir():
        pytest.skip(f".models/{MODEL} is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.5
    # A generous op timeout: a loaded 2-core CI must not turn a hit into a
    # miss, nor a Responses read into a 503.
    config.gateway.response_cache = ResponseCacheConfig(
        enabled=cache, store="redis", redis_url=redis_url, op_timeout_seconds=1.0, connect_timeout_seconds=1.0)
    tune(config)
    options = MeshOptions(engines=2, backend="sim", gateways=2, model=MODEL, free_ports=True, run_dir=run_dir)
    mesh = start_on_free_ports(config, options)
    try:
        yield mesh
    finally:
        mesh.stop_all()
