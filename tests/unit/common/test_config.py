from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import (
    ConfigError,
    MeshConfig,
    SchedulerConfig,
    config_from_dict,
    load_config,
)

ROOT = Path(__file__).resolve().parents[3]


def test_default_config_file_loads() -> None:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    assert config.models, "the default config serves at least one model"
    assert config.engines.count >= 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"scheduler": {"polcy": "x"}}, "config.scheduler: unknown setting(s) polcy"),
        ({"scheduler": {"aging": {"p2_seconds": "soon"}}}, "config.scheduler.aging.p2_seconds: expected a number"),
        ({"scheduler": {"port": 1.5}}, "config.scheduler.port: expected an integer"),
        ({"scheduler": {"port": True}}, "config.scheduler.port: expected an integer"),
        ({"engines": {"backend": "gpu"}}, "config.engines.backend: 'gpu' is not one of"),
        ({"models": {"name": "x"}}, "config.models: expected a list"),
        ({"models": [{"name": 3}]}, "config.models[0].name: expected a string"),
        ({"gateway": []}, "config.gateway: expected a mapping"),
    ],
)
def test_bad_settings_name_their_path(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(MeshConfig, data)
    assert message in str(info.value)


def test_ints_widen_to_floats_and_nesting_works() -> None:
    config = config_from_dict(MeshConfig, {"scheduler": {"aging": {"p1_seconds": 5}}})
    assert config.scheduler.aging.p1_seconds == 5.0
    assert isinstance(config.scheduler.aging.p1_seconds, float)
    assert config.scheduler == SchedulerConfig(aging=config.scheduler.aging)


def test_engine_config_derives_ids_and_ports() -> None:
    config = config_from_dict(
        MeshConfig,
        {"models": [{"name": "m", "path": "p"}], "engines": {"base_port": 7000, "metrics_base_port": 0}},
    )
    first, second = config.engine_config(0), config.engine_config(1)
    assert (first.engine_id, first.port, first.model) == ("engine-0", 7000, "m")
    assert (second.engine_id, second.port, second.metrics_port) == ("engine-1", 7001, 0)
    # Each engine gets its own copy, not a shared template.
    second.block_size = 128
    assert config.engines.template.block_size == 16


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: [unclosed")
    with pytest.raises(ConfigError, match=r"bad.yaml"):
        load_config(bad)
