"""The validation phase: every bound and cross-setting rule of a mesh config,
checked once at load (`load_config` runs it after the type phase).

Each rule names the setting's full path as written in the YAML
("engines.template.block_size", "gateway.api_keys[0].tenant"), so one rule
serves the mesh's engines and an engine run alone (`kvmesh engine` derives
its settings from `engines.template` too). The bounds are those documented
where each field is declared; a rule here and its field's comment say the
same thing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .addresses import split_host_port
from .engines import EngineConfig
from .errors import ConfigError
from .gateway import ApiKeyConfig
from .mesh import TOOL_PARSERS, MeshConfig
from .peers import PeersConfig
from .response_cache import check_cache_mode, check_response_cache
from .responses import check_responses
from .scheduler import AdminKeyConfig, SchedulerConfig
from .spares import SparesConfig

__all__ = ["api_key_digest", "check_admin_keys", "check_api_keys", "validate_config"]

# The request priority classes, best first: P0 interactive .. P2 batch.
_PRIORITY_CLASSES = (0, 1, 2)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_PORT = 65535
# Faster load reports than every 5 ms would flood the scheduler with
# messages that carry no news (10 engines -> 2,000 messages/s).
MIN_REPORT_INTERVAL_SECONDS = 0.005
# A hang floor under a second takes a scheduling hiccup for a hang.
MIN_HANG_FLOOR_SECONDS = 1.0


def api_key_digest(key: ApiKeyConfig) -> str:
    """The key's SHA-256 as the gateway compares it: lower-case hex, trimmed."""
    return key.sha256.strip().lower()


@dataclass(frozen=True)
class _Section:
    """One settings object and its full path, with the checks rules share."""

    path: str
    settings: Any

    def at(self, name: str) -> _Section:
        return _Section(f"{self.path}.{name}", getattr(self.settings, name))

    def fail(self, name: str, problem: str) -> NoReturn:
        raise ConfigError(f"{self.path}.{name}: {problem}")

    def positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self.settings, name)
            if not value > 0:
                self.fail(name, f"must be > 0, got {value}")

    def non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self.settings, name)
            if not value >= 0:
                self.fail(name, f"must be >= 0, got {value}")

    def within(self, name: str, low: float, high: float) -> None:
        value = getattr(self.settings, name)
        if not low <= value <= high:
            self.fail(name, f"must be within {low:g} .. {high:g}, got {value}")

    def ports(self, *names: str) -> None:
        """TCP ports; 0 = off or any free port, as each field says."""
        for name in names:
            self.within(name, 0, _MAX_PORT)

    def multiple_of(self, name: str, unit: int, unit_name: str) -> None:
        value = getattr(self.settings, name)
        if value % unit:
            self.fail(name, f"{value} is not a multiple of {unit_name} {unit}")


def validate_config(config: MeshConfig, where: str = "config") -> None:
    """Raise ConfigError for the first setting out of its bounds. `where`
    prefixes each path (the file name at load)."""
    mesh = _Section(where, config)
    mesh.positive("hash_block_tokens")
    _check_models(mesh)
    # The scheduler before the engines: an engine's rules compare with it.
    _check_scheduler_timing(mesh.at("scheduler"))
    _check_scheduler_limits(mesh.at("scheduler"))
    _check_scaling(mesh.at("scheduler").at("scaling"))
    _check_engines(mesh)
    _check_engine(mesh.at("engines").at("template"), config)
    if config.engines.template.advertise_address and config.engines.count > 1:
        mesh.at("engines").at("template").fail(
            "advertise_address", "one address for every engine `kvmesh up` starts; set it per engine "
            "process (`kvmesh engine --advertise-address`) or use engines.count 1")
    _check_gateway(mesh.at("gateway"))
    _check_api_keys(mesh.at("gateway"))
    check_admin_keys(config.scheduler.admin_keys, f"{where}.scheduler.admin_keys")
    envoy = mesh.at("envoy")
    envoy.ports("port", "admin_port")
    envoy.non_negative("base_id")
    _check_partitions(mesh)
    mesh.at("resume").non_negative("grace_seconds")
    _check_deadlines(mesh.at("deadlines"))
    mesh.at("responses").positive("ttl_seconds", "max_bytes")
    mesh.at("responses").non_negative("max_entries")
    check_responses(f"{where}.responses", config.responses, config.gateway.response_cache.redis_url)
    _check_batch(mesh.at("batch"))
    _check_tracing(mesh.at("tracing"))
    _check_alerts(mesh.at("alerts"))


def _check_deadlines(deadlines: _Section) -> None:
    deadlines.within("multiple", 1, 100)
    deadlines.positive("window_samples", "window_seconds", "min_samples")
    if deadlines.settings.min_samples > deadlines.settings.window_samples:
        deadlines.fail("min_samples", f"must be <= window_samples ({deadlines.settings.window_samples}), "
                       f"got {deadlines.settings.min_samples}")
    for kind in ("queue_wait", "first_token", "token_stall", "generation"):
        bounds = deadlines.at(kind)
        bounds.positive("floor_seconds")
        bounds.non_negative("ceiling_seconds")


def _check_batch(batch: _Section) -> None:
    batch.ports("port", "metrics_port")
    batch.within("max_file_bytes", 1024, 1024**3)
    batch.positive("max_lines", "max_in_flight", "max_attempts", "lease_seconds", "poll_seconds",
                   "completion_window_seconds", "drain_seconds")
    digest = batch.settings.internal_key_sha256.strip().lower()
    if digest and not _HEX64.fullmatch(digest):
        batch.fail("internal_key_sha256", f"expected 64 hex digits (kvmesh key hash KEY), got {digest!r}")
    url = batch.settings.gateway_url
    if url and not url.startswith(("http://", "https://")):
        batch.fail("gateway_url", f"expected http(s)://host:port of a gateway or Envoy, got {url!r}")
    if batch.settings.poll_seconds * 2 >= batch.settings.lease_seconds:
        batch.fail("poll_seconds", f"must be < lease_seconds / 2 ({batch.settings.lease_seconds / 2:g}): "
                   "a lease is renewed at least twice before it expires")
    batch.non_negative("admit_margin_seconds")
    room = batch.settings.lease_seconds - batch.settings.poll_seconds
    if batch.settings.admit_margin_seconds >= room:
        batch.fail("admit_margin_seconds", f"must be < lease_seconds - poll_seconds ({room:g}): a lease "
                   "about to be renewed must still leave time to send lines")


def _check_alerts(alerts: _Section) -> None:
    alerts.positive("p0_ttft_p99_seconds", "migrations_per_minute", "aging_fraction")
    for name in ("aging_fraction", "kv_cache_full_ratio", "rejection_ratio"):
        alerts.within(name, 0, 1)
    if alerts.settings.flaps_per_15m < 1:
        alerts.fail("flaps_per_15m", f"must be >= 1, got {alerts.settings.flaps_per_15m}")


def _check_models(mesh: _Section) -> None:
    seen: set[str] = set()
    for i, model in enumerate(mesh.settings.models):
        entry = _Section(f"{mesh.path}.models[{i}]", model)
        if not model.name:
            entry.fail("name", "required")
        if model.name in seen:
            entry.fail("name", f"{model.name!r} is listed twice")
        seen.add(model.name)
        entry.non_negative("max_model_len")
        if model.tool_parser not in TOOL_PARSERS:
            entry.fail("tool_parser", f"must be one of {', '.join(TOOL_PARSERS)}, got {model.tool_parser!r}")


def _check_engines(mesh: _Section) -> None:
    engines = mesh.at("engines")
    engines.non_negative("count")
    engines.ports("base_port", "metrics_base_port", "http_base_port")
    last = max(engines.settings.count - 1, 0)
    for name in ("base_port", "metrics_base_port", "http_base_port"):
        base = getattr(engines.settings, name)
        if base and base + last > _MAX_PORT:
            engines.fail(name, f"engine {last} would listen on {base + last}, past {_MAX_PORT}")


def _check_engine(engine: _Section, config: MeshConfig) -> None:
    e: EngineConfig = engine.settings
    if not e.engine_id:
        engine.fail("engine_id", "required")
    engine.ports("port", "metrics_port", "http_port")
    if e.advertise_address:
        try:
            split_host_port(e.advertise_address)
        except ValueError as exc:
            engine.fail("advertise_address", str(exc))
    _check_scheduler_addresses(engine, e.scheduler_addresses)
    engine.positive("block_size", "total_blocks", "max_running", "weight")
    engine.non_negative("p0_headroom")
    engine.multiple_of("block_size", config.hash_block_tokens, "hash_block_tokens")
    if e.report_interval_seconds < MIN_REPORT_INTERVAL_SECONDS:
        engine.fail("report_interval_seconds",
                    f"must be >= {MIN_REPORT_INTERVAL_SECONDS}, got {e.report_interval_seconds}")
    stale = config.scheduler.stale_report_seconds
    if e.report_interval_seconds >= stale:
        engine.fail("report_interval_seconds",
                    f"must be below scheduler.stale_report_seconds ({stale}), else the scheduler "
                    f"takes the engine for stale between two reports; got {e.report_interval_seconds}")
    engine.non_negative("stop_grace_seconds", "coalesce_interval_ms", "coalesce_min_running")
    engine.within("hang_floor_seconds", MIN_HANG_FLOOR_SECONDS, float("inf"))
    engine.within("hang_step_multiple", 1.0, float("inf"))
    engine.within("hang_busy_multiple", 1.0, float("inf"))
    _check_classes(engine, "coalesce_unpaced_priorities", e.coalesce_unpaced_priorities)
    sim = engine.at("sim")
    sim.non_negative("prefill_seconds_per_token", "decode_seconds_per_step",
                     "decode_seconds_per_sequence", "decode_seconds_per_kilotoken_context",
                     "speed_factor")
    sim.positive("chunk_tokens")
    sim.within("vocab_size", 2, float("inf"))
    sim.within("eos_probability", 0.0, 1.0)
    for i, step in enumerate(e.sim.speed_schedule):
        entry = sim.at("speed_schedule")
        if not (step.at_seconds >= 0 and 0 <= step.factor < float("inf")):
            entry.fail(f"[{i}]", f"at_seconds and factor must be >= 0 (factor finite), got {step}")
    vllm = engine.at("vllm")
    vllm.positive("kv_cache_gib", "max_num_seqs")
    vllm.non_negative("max_num_batched_tokens", "block_size")
    vllm.ports("kv_events_port")
    vllm.multiple_of("block_size", config.hash_block_tokens, "hash_block_tokens")
    batch = e.vllm.max_num_seqs + e.p0_headroom
    if 0 < e.vllm.max_num_batched_tokens < batch:
        # vLLM refuses to start when a step's token budget cannot hold one
        # token of every sequence its batch may run.
        vllm.fail("max_num_batched_tokens",
                  f"must be 0 (vLLM's default) or >= max_num_seqs + p0_headroom ({batch}), "
                  f"got {e.vllm.max_num_batched_tokens}")


def _check_classes(section: _Section, name: str, classes: Sequence[int]) -> None:
    bad = sorted(p for p in classes if p not in _PRIORITY_CLASSES)
    if bad:
        section.fail(name, f"{bad} are not priority classes {_PRIORITY_CLASSES}")


def _check_scheduler_timing(scheduler: _Section) -> None:
    scheduler.ports("port", "metrics_port")
    url = scheduler.settings.incarnations_redis_url
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        scheduler.fail("incarnations_redis_url", f"expected redis://host:port/db, got {url!r}")
    scheduler.at("aging").positive("p1_seconds", "p2_seconds")
    scheduler.positive(
        "stale_report_seconds", "queued_update_seconds", "tick_seconds",
        "prefill_tokens_per_second", "initial_service_seconds",
        "dispatch_rate_window_seconds", "inflight_prefix_seconds",
    )
    scheduler.non_negative("sticky_margin_seconds", "engine_grace_seconds", "engine_return_seconds",
                           "predicted_ttft_margin_seconds")


def _check_scaling(scaling: _Section) -> None:
    s = scaling.settings
    scaling.positive("interval_seconds", "fast_rate_seconds", "max_step_up", "max_step_down")
    scaling.non_negative("min_engines", "scale_in_hold_seconds", "cold_start_wait_seconds")
    if s.max_engines < s.min_engines:
        scaling.fail("max_engines", f"must be >= min_engines ({s.min_engines}), got {s.max_engines}")
    if s.slow_rate_seconds < s.fast_rate_seconds:
        scaling.fail("slow_rate_seconds", f"must be >= fast_rate_seconds ({s.fast_rate_seconds:g})")
    if len(s.ttft_targets_seconds) != len(_PRIORITY_CLASSES) or any(t <= 0 for t in s.ttft_targets_seconds):
        scaling.fail("ttft_targets_seconds", f"need 3 targets > 0 [P0, P1, P2], got {s.ttft_targets_seconds}")
    if not 0.5 <= s.quantile < 1:
        scaling.fail("quantile", f"must be in [0.5, 1), got {s.quantile}")
    scaling.within("queue_wait_share", 0, 1)
    scaling.within("kv_pressure", 0, 1)


def _check_scheduler_limits(scheduler: _Section) -> None:
    s: SchedulerConfig = scheduler.settings
    n = len(_PRIORITY_CLASSES)
    if len(s.queue_caps) != n or any(c < 0 for c in s.queue_caps):
        scheduler.fail("queue_caps", f"need {n} caps >= 0 [P0, P1, P2], got {s.queue_caps}")
    if len(s.queue_ttl_seconds) != n or any(t <= 0 for t in s.queue_ttl_seconds):
        scheduler.fail("queue_ttl_seconds",
                       f"need {n} TTLs > 0 [P0, P1, P2], got {s.queue_ttl_seconds}")
    scheduler.non_negative("tenant_queue_cap", "batch_queue_cap", "decode_headroom_tokens", "engine_queue_slack",
                           "p0_reserved_leases", "max_preemptions")
    _check_classes(scheduler, "preempt_classes", s.preempt_classes)
    if not 0 < s.retry_after_min_seconds <= s.retry_after_max_seconds:
        scheduler.fail("retry_after_min_seconds",
                       f"need 0 < retry_after_min_seconds <= retry_after_max_seconds, got "
                       f"{s.retry_after_min_seconds} and {s.retry_after_max_seconds}")
    scheduler.positive("approx_prefix_capacity")
    scheduler.non_negative("placement_candidates")
    _check_spares(scheduler.at("spares"))
    _check_peers(scheduler.at("peers"))
    for name, profile in s.policy_profiles.items():
        scorers = _Section(f"{scheduler.path}.policy_profiles.{name}.scorers", profile.scorers)
        for scorer, weight in profile.scorers.items():
            if weight < 0:
                scorers.fail(scorer, f"weight must be >= 0, got {weight}")


def _check_spares(spares: _Section) -> None:
    s: SparesConfig = spares.settings
    spares.non_negative("count", "promote_hold_seconds")
    spares.positive("demote_hold_seconds", "demote_below_utilization")
    spares.within("demote_below_utilization", 0.0, 1.0)
    for model, count in s.models.items():
        if count < 0:
            spares.at("models").fail(model, f"spares must be >= 0, got {count}")
    targets = s.ttft_target_seconds
    if len(targets) != len(_PRIORITY_CLASSES) or any(t < 0 for t in targets):
        spares.fail("ttft_target_seconds", f"need {len(_PRIORITY_CLASSES)} targets >= 0 [P0, P1, P2], got {targets}")


def _check_peers(peers: _Section) -> None:
    p: PeersConfig = peers.settings
    _check_scheduler_addresses(peers, p.addresses, "addresses")
    peers.positive("publish_interval_seconds", "heartbeat_seconds", "stale_seconds", "hold_seconds")
    peers.non_negative("vanished_head_seconds")
    if p.stale_seconds <= p.heartbeat_seconds:
        peers.fail("stale_seconds", f"must be > heartbeat_seconds ({p.heartbeat_seconds}), got {p.stale_seconds}")


def _check_scheduler_addresses(section: _Section, addresses: Sequence[str], key: str = "scheduler_addresses") -> None:
    """`scheduler_addresses`: each host:port, none twice."""
    for i, address in enumerate(addresses):
        try:
            split_host_port(address)
        except ValueError as exc:
            section.fail(f"{key}[{i}]", str(exc))
        if address in addresses[:i]:
            section.fail(f"{key}[{i}]", f"{address!r} is listed twice")


def _check_gateway(gateway: _Section) -> None:
    gateway.ports("http_port", "grpc_port", "metrics_port")
    _check_scheduler_addresses(gateway, gateway.settings.scheduler_addresses)
    gateway.positive("heartbeat_seconds", "max_generation_seconds", "max_body_bytes",
                     "default_max_tokens")
    gateway.non_negative("max_migrations", "drain_unready_seconds")
    g = gateway.settings
    if g.drain_seconds is not None:
        gateway.non_negative("drain_seconds")
    if g.drain_seconds is not None and g.drain_unready_seconds > g.drain_seconds:
        gateway.fail("drain_unready_seconds", f"must be <= drain_seconds ({g.drain_seconds}), "
                     f"got {g.drain_unready_seconds}")
    check_response_cache(f"{gateway.path}.response_cache", g.response_cache)


def _check_api_keys(gateway: _Section) -> None:
    check_api_keys(gateway.settings.api_keys, f"{gateway.path}.api_keys")


def check_api_keys(keys: Sequence[ApiKeyConfig], path: str, seen: set[str] | None = None) -> None:
    """The rules of a list of API keys written at `path`; `seen` holds the
    digests of keys listed elsewhere (a key file's are checked against the
    config's), and gets these keys' added."""
    seen = set() if seen is None else seen
    for i, key in enumerate(keys):
        entry = _Section(f"{path}[{i}]", key)
        digest = api_key_digest(key)
        if not _HEX64.fullmatch(digest):
            entry.fail("sha256", f"expected 64 hex digits (kvmesh key hash KEY), got {key.sha256!r}")
        if digest in seen:
            entry.fail("sha256", "duplicate key")
        seen.add(digest)
        if not key.tenant:
            entry.fail("tenant", "required")
        if key.priority_ceiling not in _PRIORITY_CLASSES:
            entry.fail("priority_ceiling", f"must be 0, 1 or 2, got {key.priority_ceiling}")
        entry.non_negative("requests_per_second", "tokens_per_minute", "max_generation_seconds")
        check_cache_mode(f"{entry.path}.response_cache", key.response_cache)


def check_admin_keys(keys: Sequence[AdminKeyConfig], path: str, seen: set[str] | None = None) -> None:
    """The rules of a list of admin keys written at `path` (`seen`: digests
    listed elsewhere, as for `check_api_keys`)."""
    seen = set() if seen is None else seen
    for i, key in enumerate(keys):
        entry = _Section(f"{path}[{i}]", key)
        digest = key.sha256.strip().lower()
        if not _HEX64.fullmatch(digest):
            entry.fail("sha256", f"expected 64 hex digits (kvmesh key hash TOKEN), got {key.sha256!r}")
        if digest in seen:
            entry.fail("sha256", "duplicate key")
        seen.add(digest)
        if not key.name.strip():
            entry.fail("name", "required: who holds the key (admin calls are logged with it)")


def _check_partitions(mesh: _Section) -> None:
    network = mesh.at("network")
    network.within("keepalive_time_seconds", 1, 600)
    network.within("keepalive_timeout_seconds", 1, 600)
    if network.settings.silent_peer_seconds != 0:   # 0 = off
        network.within("silent_peer_seconds", 0.5, 60)
    mesh.at("fencing").non_negative("confirm_seconds", "startup_grace_seconds", "rejoin_grace_seconds")


def _check_tracing(tracing: _Section) -> None:
    t = tracing.settings
    if t.otlp_endpoint and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", t.otlp_endpoint):
        tracing.fail("otlp_endpoint", f"expected an http:// or https:// URL (the OTLP/HTTP receiver, e.g. "
                     f"http://127.0.0.1:4318), got {t.otlp_endpoint!r}")
    if not t.service_name:
        tracing.fail("service_name", "must not be empty")
    tracing.within("sample_ratio", 0.0, 1.0)
    tracing.positive("export_timeout_seconds")
    for name in t.headers:
        if not re.fullmatch(r"[a-z0-9!#$%&'*+.^_`|~-]+", name):
            tracing.fail("headers", f"{name!r} is not a lower-case HTTP header name")
