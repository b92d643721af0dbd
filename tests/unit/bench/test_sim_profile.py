"""The calibrated sim profile: its predictions against its source's figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, MeshConfig
from services.engine.sim.profiles import apply_profile, check_profile, load_profile

PROFILE = Path(__file__).resolve().parents[3] / "config" / "sim-profiles" / "llama3-8b-a100.yaml"


def test_sim_step_times_track_the_vidur_profile() -> None:
    profile = load_profile(PROFILE)
    rows = check_profile(profile)
    assert len(rows) >= 15
    for row in rows:
        if row.label.startswith("decode"):
            assert abs(row.error) < 0.05, row
        elif int(row.label.split()[1]) >= 384:
            assert abs(row.error) < 0.10, row
        else:  # small chunks: the additive model overshoots the memory-bound knee
            assert abs(row.error) < 0.30, row


def test_apply_profile_sets_engines_and_the_schedulers_prefill_speed() -> None:
    config = MeshConfig()
    profile = load_profile(PROFILE)
    apply_profile(config, profile, speed_factor=2.0)
    t = config.engines.template
    assert (t.total_blocks, t.max_running, t.block_size) == (29206, 128, 16)
    assert t.sim.prefill_seconds_per_token == profile.sim.prefill_seconds_per_token
    assert t.sim.speed_factor == 2.0
    assert config.scheduler.prefill_tokens_per_second == pytest.approx(1 / (0.0000529 * 2))


def test_bad_profiles_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text(PROFILE.read_text().replace("chunk_tokens:", "chunk_tokenz:"))
    with pytest.raises(ConfigError, match="chunk_tokenz"):
        load_profile(bad)
    bad.write_text("name: x\n")
    with pytest.raises(ConfigError, match="lacks"):
        load_profile(bad)
