"""Which model an engine serves, and where its files are."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.config import EngineConfig, MeshConfig

__all__ = ["ModelSpec", "REPO_ROOT", "resolve_model"]

REPO_ROOT = Path(__file__).resolve().parents[2]
# A sim engine serving no configured model still needs a name and a context.
DEFAULT_SIM_MODEL = "sim"
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path | None          # the HF directory, None when not configured
    max_model_len: int          # 0 = unknown (the backend decides)


def resolve_model(config: MeshConfig, engine: EngineConfig) -> ModelSpec:
    """engine.model names an entry of config.models (ConfigError if unknown);
    empty = the first model, or a model-less sim named "sim"."""
    if not engine.model and not config.models:
        return ModelSpec(DEFAULT_SIM_MODEL, None, 0)
    model = config.model(engine.model) if engine.model else config.models[0]
    path = Path(model.path) if model.path else None
    if path is not None and not path.is_absolute():
        path = REPO_ROOT / path
    max_len = model.max_model_len or _config_max_len(path)
    return ModelSpec(model.name, path, max_len)


def _config_max_len(path: Path | None) -> int:
    if path is None:
        return 0
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else 0
