"""The bounds phase of loading a config: every rule names the setting's full
path, and `load_config` runs it, so no component needs to check again."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import (
    ConfigError,
    MeshConfig,
    api_key_digest,
    config_from_dict,
    load_config,
    validate_config,
)
from services.common.config.gateway import ApiKeyConfig

ROOT = Path(__file__).resolve().parents[3]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check(data: dict[str, Any]) -> None:
    validate_config(config_from_dict(MeshConfig, data))


def test_defaults_and_the_shipped_config_are_valid() -> None:
    validate_config(MeshConfig())
    validate_config(load_config(ROOT / "config" / "kvmesh.yaml"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # scheduler: aging, admission limits, timings, placement
        ({"scheduler": {"aging": {"p2_seconds": 0}}}, "config.scheduler.aging.p2_seconds: must be > 0"),
        ({"scheduler": {"queue_caps": [1, 2]}}, "config.scheduler.queue_caps: need 3 caps >= 0"),
        ({"scheduler": {"queue_ttl_seconds": [1.0, 0.0, 1.0]}}, "config.scheduler.queue_ttl_seconds: need 3 TTLs > 0"),
        ({"scheduler": {"retry_after_min_seconds": 0.0}}, "config.scheduler.retry_after_min_seconds: need 0 <"),
        ({"scheduler": {"retry_after_min_seconds": 9, "retry_after_max_seconds": 5}},
         "config.scheduler.retry_after_min_seconds: need 0 <"),
        ({"scheduler": {"tenant_queue_cap": -1}}, "config.scheduler.tenant_queue_cap: must be >= 0"),
        ({"scheduler": {"tick_seconds": 0}}, "config.scheduler.tick_seconds: must be > 0"),
        # scaling
        ({"scheduler": {"scaling": {"min_engines": 3, "max_engines": 2}}},
         "config.scheduler.scaling.max_engines: must be >= min_engines (3)"),
        ({"scheduler": {"scaling": {"ttft_targets_seconds": [0.5, 2]}}},
         "config.scheduler.scaling.ttft_targets_seconds: need 3 targets > 0"),
        ({"scheduler": {"scaling": {"max_step_up": 0}}}, "config.scheduler.scaling.max_step_up: must be > 0"),
        ({"scheduler": {"scaling": {"fast_rate_seconds": 30, "slow_rate_seconds": 10}}},
         "config.scheduler.scaling.slow_rate_seconds: must be >= fast_rate_seconds"),
        ({"scheduler": {"stale_report_seconds": -1}}, "config.scheduler.stale_report_seconds: must be > 0"),
        ({"scheduler": {"dispatch_rate_window_seconds": 0}},
         "config.scheduler.dispatch_rate_window_seconds: must be > 0"),
        ({"scheduler": {"engine_grace_seconds": -1}}, "config.scheduler.engine_grace_seconds: must be >= 0"),
        ({"scheduler": {"engine_queue_slack": -1}}, "config.scheduler.engine_queue_slack: must be >= 0"),
        ({"scheduler": {"approx_prefix_capacity": 0}}, "config.scheduler.approx_prefix_capacity: must be > 0"),
        ({"scheduler": {"policy_profiles": {"mine": {"scorers": {"load": -1}}}}},
         "config.scheduler.policy_profiles.mine.scorers.load: weight must be >= 0"),
        ({"scheduler": {"port": 70000}}, "config.scheduler.port: must be within 0 .. 65535"),
        ({"scheduler": {"preempt_classes": [0, 5]}},
         "config.scheduler.preempt_classes: [5] are not priority classes (0, 1, 2)"),
        ({"scheduler": {"max_preemptions": -1}}, "config.scheduler.max_preemptions: must be >= 0"),
        # engines: the template every engine (and `kvmesh engine`) starts from
        ({"hash_block_tokens": 0}, "config.hash_block_tokens: must be > 0"),
        ({"engines": {"template": {"block_size": 24}}},
         "config.engines.template.block_size: 24 is not a multiple of hash_block_tokens 16"),
        ({"engines": {"template": {"total_blocks": 0}}}, "config.engines.template.total_blocks: must be > 0"),
        ({"engines": {"template": {"report_interval_seconds": 0.001}}},
         "config.engines.template.report_interval_seconds: must be >= 0.005"),
        ({"engines": {"template": {"report_interval_seconds": 3.0}}},
         "config.engines.template.report_interval_seconds: must be below scheduler.stale_report_seconds"),
        ({"engines": {"template": {"stop_grace_seconds": -1}}},
         "config.engines.template.stop_grace_seconds: must be >= 0"),
        ({"engines": {"template": {"hang_floor_seconds": 0.5}}},
         "config.engines.template.hang_floor_seconds: must be within 1 .. inf, got 0.5"),
        ({"engines": {"template": {"hang_step_multiple": 0.9}}},
         "config.engines.template.hang_step_multiple: must be within 1 .. inf, got 0.9"),
        ({"engines": {"template": {"coalesce_unpaced_priorities": [0, 3]}}},
         "config.engines.template.coalesce_unpaced_priorities: [3] are not priority classes (0, 1, 2)"),
        ({"engines": {"template": {"sim": {"speed_factor": -1}}}},
         "config.engines.template.sim.speed_factor: must be >= 0"),
        ({"engines": {"template": {"sim": {"eos_probability": 1.5}}}},
         "config.engines.template.sim.eos_probability: must be within 0 .. 1"),
        ({"engines": {"template": {"p0_headroom": -1}}}, "config.engines.template.p0_headroom: must be >= 0"),
        ({"engines": {"template": {"p0_headroom": 4, "vllm": {"max_num_seqs": 16, "max_num_batched_tokens": 8}}}},
         "config.engines.template.vllm.max_num_batched_tokens: must be 0 (vLLM's default) or >= max_num_seqs"),
        ({"engines": {"template": {"vllm": {"block_size": 100}}}},
         "config.engines.template.vllm.block_size: 100 is not a multiple of hash_block_tokens 16"),
        ({"engines": {"count": 3, "base_port": 65534}},
         "config.engines.base_port: engine 2 would listen on 65536"),
        # gateway
        ({"gateway": {"heartbeat_seconds": 0}}, "config.gateway.heartbeat_seconds: must be > 0"),
        ({"gateway": {"max_migrations": -1}}, "config.gateway.max_migrations: must be >= 0"),
        ({"gateway": {"max_body_bytes": 0}}, "config.gateway.max_body_bytes: must be > 0"),
        # models, envoy
        ({"models": [{"name": "m", "path": "a"}, {"name": "m", "path": "b"}]},
         "config.models[1].name: 'm' is listed twice"),
        ({"models": [{"path": "a"}]}, "config.models[0].name: required"),
        ({"envoy": {"admin_port": -1}}, "config.envoy.admin_port: must be within 0 .. 65535"),
        # silent partitions: keepalive, fencing
        ({"network": {"keepalive_time_seconds": 0.5}},
         "config.network.keepalive_time_seconds: must be within 1 .. 600, got 0.5"),
        ({"network": {"keepalive_timeout_seconds": 0}},
         "config.network.keepalive_timeout_seconds: must be within 1 .. 600"),
        ({"fencing": {"confirm_seconds": -1}}, "config.fencing.confirm_seconds: must be >= 0"),
        ({"fencing": {"rejoin_grace_seconds": -1}}, "config.fencing.rejoin_grace_seconds: must be >= 0"),
    ],
)
def test_out_of_bounds_settings_name_their_path(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check(data)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ({"sha256": "xyz", "tenant": "t"}, "sha256: expected 64 hex digits"),
        ({"sha256": sha("a"), "tenant": ""}, "tenant: required"),
        ({"sha256": sha("a"), "tenant": "t", "priority_ceiling": 3}, "priority_ceiling: must be 0, 1 or 2"),
        ({"sha256": sha("a"), "tenant": "t", "requests_per_second": -1}, "requests_per_second: must be >= 0"),
        ({"sha256": sha("a"), "tenant": "t", "max_generation_seconds": -1},
         "max_generation_seconds: must be >= 0"),
    ],
)
def test_bad_key_config_names_the_setting(key: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check({"gateway": {"api_keys": [key]}})
    assert f"config.gateway.api_keys[0].{message}" in str(info.value)


def test_a_key_listed_twice_is_an_error_whatever_its_case() -> None:
    keys = [{"sha256": sha("a"), "tenant": "t"}, {"sha256": f" {sha('a').upper()} ", "tenant": "u"}]
    with pytest.raises(ConfigError, match=r"config\.gateway\.api_keys\[1\]\.sha256: duplicate key"):
        check({"gateway": {"api_keys": keys}})
    assert api_key_digest(ApiKeyConfig(sha256=f" {sha('a').upper()} ")) == sha("a")


def test_load_runs_the_bounds_phase_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"heartbeat_seconds": 0}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}.gateway.heartbeat_seconds: must be > 0" in str(info.value)


def test_queue_policies_default_to_round_robin_tenants_and_fifo() -> None:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    assert (config.scheduler.queue_fairness, config.scheduler.queue_ordering) == (
        "round_robin_tenants", "fifo")


@pytest.mark.parametrize("address", [
    "kvmesh-engine-0.kvmesh-engine.kvmesh.svc.cluster.local:50100", "localhost:1", "10.0.0.7:50100",
    "[::1]:50100",
])
def test_an_engine_may_announce_a_dns_name_or_an_ip(address: str) -> None:
    check({"engines": {"count": 1, "template": {"advertise_address": address}}})


@pytest.mark.parametrize("address", [
    "kvmesh-engine-0.kvmesh-engine", "host:0", "host:99999", ":50100", "http://host:50100", "::1:50100",
    "a b:1",
])
def test_an_announced_address_is_host_colon_port(address: str) -> None:
    with pytest.raises(ConfigError, match=r"engines\.template\.advertise_address: '.*': (expected|port|an IPv6)"):
        check({"engines": {"count": 1, "template": {"advertise_address": address}}})


def test_one_announced_address_is_not_for_several_engines() -> None:
    with pytest.raises(ConfigError, match="advertise_address: one address for every engine"):
        check({"engines": {"count": 2, "template": {"advertise_address": "e:1"}}})
