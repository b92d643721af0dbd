"""Engine settings: the simulated GPU's cost model, vLLM's arguments, one
engine process, and how `kvmesh up` starts several from one template.

In the YAML these live under `engines` (`engines.template` is one engine);
`MeshConfig.engine_config(i)` derives engine i from the template. Bounds are
checked at load by `validation.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .addresses import scheduler_addresses

__all__ = ["EngineConfig", "EnginesConfig", "SimCostConfig", "VllmConfig"]


@dataclass
class SimSpeedStep:
    """One entry of `speed_schedule` (services/engine/sim/speed.py)."""

    # Seconds after the sim's step loop started. >= 0.
    at_seconds: float = 0.0
    # Steps cost this many times their modelled time from then on. >= 0.
    factor: float = 1.0


@dataclass
class SimCostConfig:
    """The simulated GPU's cost model (services/engine/sim/cost_model.py).

    Defaults approximate a small model on one modern GPU (see that module's
    docstring for sources); `speed_factor` scales every cost, and 0 makes the
    simulator free, which benchmarks of the mesh's own overhead use.
    """

    # The four costs below are seconds, each >= 0.
    # Seconds to prefill one prompt token (compute-bound, batched).
    prefill_seconds_per_token: float = 0.00005
    # Fixed seconds per decode step, whatever the batch (weights read once).
    decode_seconds_per_step: float = 0.008
    # Extra seconds per running sequence per step (KV reads grow with batch).
    decode_seconds_per_sequence: float = 0.0002
    # Extra seconds per 1k tokens of context summed over the batch.
    decode_seconds_per_kilotoken_context: float = 0.00005
    # Most prompt tokens prefilled in one step (chunked prefill budget). > 0.
    chunk_tokens: int = 512
    # Multiplies all costs; 0 = no simulated time at all. Bounds: >= 0.
    speed_factor: float = 1.0
    # Speed changes at run time (services/engine/sim/speed.py): from each
    # entry's at_seconds after start, steps cost `factor` x more (on top of
    # speed_factor); empty = 1 throughout. `POST /sim/speed?factor=F` on the
    # engine's metrics port overrides it live.
    speed_schedule: list[SimSpeedStep] = field(default_factory=list)
    # Vocabulary the deterministic text is drawn from (token ids). Used only
    # when the model directory has no tokenizer.json; otherwise the
    # tokenizer's own vocabulary size applies. Bounds: >= 2.
    vocab_size: int = 32000
    # Chance in [0, 1] that the sim's next token is EOS (decided by the same
    # deterministic hash as the token itself). 0 = every generation runs to
    # max_tokens, which keeps benchmark output lengths exact.
    eos_probability: float = 0.0
    # Run one 2-token generation before the engine reports healthy. Off only
    # for a sim slowed so far that it would take tens of seconds (a test of
    # 12 s tokens); the engine then serves its first request cold.
    warm_up: bool = True


@dataclass
class VllmConfig:
    """Settings handed to vLLM's AsyncEngineArgs."""

    # KV cache size in GiB on CPU (vLLM-CPU refuses to start with its default
    # on these machines: it asks for more than the NUMA node has). > 0.
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
    # (BENCHMARKS.md, the run that pinned vLLM's processes).
    pin_vllm_processes: bool = True
    # Most sequences in vLLM's running batch. > 0.
    max_num_seqs: int = 16
    # Prompt tokens per step; 0 = vLLM's default. Bounds: 0, or at least
    # max_num_seqs + the engine's p0_headroom (vLLM refuses a smaller budget).
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    # TCP port for vLLM's ZMQ KV-event publisher; 0 = pick a free one.
    kv_events_port: int = 0
    seed: int = 0
    # Tokens per vLLM KV block; 0 = vLLM's platform default (128 on CPU,
    # 16 on GPU). Else a multiple of hash_block_tokens. The engine's
    # `block_size` setting is the simulator's; vLLM reports its own.
    block_size: int = 0


@dataclass
class EngineConfig:
    """One engine process. `kvmesh up` derives one per engine from `engines`."""

    # Required; `kvmesh up` sets engine-<i>.
    engine_id: str = "engine-0"
    backend: Literal["sim", "vllm"] = "sim"
    # Which entry of `models` this engine serves.
    model: str = ""
    # Address the gRPC, metrics and HTTP servers bind: an IP ("0.0.0.0" or
    # "::" = every interface, as in a Kubernetes pod) or a local name.
    host: str = "127.0.0.1"
    # Ports here are 0 .. 65535; a gRPC port 0 binds any free port.
    port: int = 50100
    # The `host:port` the engine announces to the scheduler, which hands it to
    # gateways to dial: a DNS name, an IPv4 or a bracketed IPv6 address, and
    # the port others reach the gRPC server on. On Kubernetes the pod's stable
    # DNS name, `$(POD_NAME).kvmesh-engine.$(POD_NAMESPACE).svc.cluster.local:
    # 50100` (`kvmesh engine --advertise-address`), never an IP: a
    # rescheduled pod keeps its name, not its address. Empty = `host` and the
    # bound port, a wildcard host (0.0.0.0, ::) replaced by this machine's
    # address (services/engine/scheduler_link.py `advertised_host`). One
    # engine's own: with engines.count > 1 the template may not set it.
    advertise_address: str = ""
    # Prometheus metrics (vLLM-named); 0 = off.
    metrics_port: int = 0
    # OpenAI-compatible HTTP endpoint, so other routers can be measured over
    # the very same engines; 0 = off.
    http_port: int = 0
    # Tokens per KV block: > 0 and a multiple of hash_block_tokens.
    # vLLM-CPU uses 128; the simulator defaults to 16 like vLLM on GPU.
    block_size: int = 16
    # KV blocks in the (simulated) GPU. > 0.
    total_blocks: int = 4096
    # Most sequences in the running batch. > 0.
    max_running: int = 64
    # Running slots beyond max_running that only P0 requests may take. The
    # backend's batch is sized max_running + p0_headroom (vLLM's
    # max_num_seqs, the simulator's batch) and the engine keeps the other
    # classes to max_running, so an interactive request joins the running
    # batch at the next step instead of waiting for a batch request to end.
    # >= 0; 0 = a P0 waits for a free slot like any request (first in line).
    p0_headroom: int = 4
    # Relative capacity for placement (a bigger GPU gets more work). > 0.
    weight: float = 1.0
    # Seconds between load reports. 0.1 s keeps placement fresh without
    # flooding the scheduler (10 messages/s per engine). Bounds: >= 0.005
    # (faster floods the scheduler with reports that carry no news) and
    # below scheduler.stale_report_seconds (else an idle engine turns stale
    # between two reports and is never placed on).
    report_interval_seconds: float = 0.1
    # Where the scheduler's gRPC service is: engines dial it (Connect stream).
    # Empty = standalone engine that registers nowhere (tests, or measuring
    # other routers over the same engines).
    scheduler_address: str = "127.0.0.1:50051"
    # Several active scheduler replicas (README "Several schedulers"): the
    # engine holds one Connect stream to EVERY one of them and tells each
    # the same (hello, load reports, KV events), so each replica sees the
    # whole fleet. Non-empty overrides `scheduler_address` (which is the
    # one-element case); each `host:port`, no duplicates. Read both through
    # `EngineConfig.schedulers()`.
    scheduler_addresses: list[str] = field(default_factory=list)
    # The drain timeout: on SIGTERM the engine turns NOT_SERVING (the
    # scheduler stops placing there), lets running generations finish for
    # this long, then hands the rest over (their streams end UNAVAILABLE and
    # the gateway migrates them from the next token), deregisters and exits.
    # Bounds: >= 0; keep it under the launcher's 10 s SIGTERM->SIGKILL grace.
    stop_grace_seconds: float = 2.0
    # Hang detection (services/engine/liveness.py): a backend that holds
    # requests and produces no output for max(hang_floor_seconds,
    # hang_step_multiple x the p99 of its recent step intervals) is hung --
    # a SIGSTOPped vLLM core, a wedged step -- and fails like a dead one: its
    # streams end UNAVAILABLE (the gateway migrates them), it stops serving,
    # and the process exits non-zero for its supervisor to restart. A step
    # interval is the time between two outputs of one request (last 256).
    # The floor covers the longest silence a healthy backend has, which no
    # step statistics predict: a request's first step (a long prompt's
    # prefill chunk on a CPU) on an otherwise idle engine, an event loop
    # stalled by a GC pass, a busy machine's scheduling; 30 s leaves a wide
    # margin over those and is how long a hung engine with fast steps holds
    # its streams. Bounds: >= 1 s (below that, a hiccup is taken for a hang).
    hang_floor_seconds: float = 30.0
    # The multiple of the p99 step interval: a step 20x slower than nearly
    # every recent one is no step but a hang; an engine under a heavy batch
    # (steps of 2 s) is then given 40 s. Bounds: >= 1.
    hang_step_multiple: float = 20.0
    # Past the bound, a backend whose processes still run or wait to run (on
    # a CPU or in its run queue: a saturated machine, a neighbour's restart)
    # is slow, not hung, for up to this multiple of the bound; a stopped or
    # blocked one is hung at the bound (services/engine/slow_or_hung.py). A
    # hang whose threads spin (a wedged GPU kernel polled by its worker) is
    # found at this multiple. 1 = the bound alone. Bounds: >= 1.
    hang_busy_multiple: float = 4.0
    # Coalescing under load (DESIGN: backpressure by coalescing): while at
    # least `coalesce_min_running` generations run here, a stream's deltas go
    # out at most every `coalesce_interval_ms`; tokens in between travel in
    # the next delta, none dropped. The first token and the final output are
    # never held. One message per token per stream costs every hop of the
    # mesh (engine write, gateway read + SSE write, Envoy) CPU a CPU-served
    # model needs; 40 ms keeps 25 updates/s per stream. 0 = a delta per step.
    # Both bounds: >= 0.
    coalesce_interval_ms: float = 40.0
    coalesce_min_running: int = 8
    # Priority classes never paced: a P0 stream is a person reading tokens as
    # they come, and it keeps a delta per step however busy the engine is;
    # the batch classes' pacing pays for it. [] = pace every class. Each of
    # 0, 1, 2.
    coalesce_unpaced_priorities: list[int] = field(default_factory=lambda: [0])
    sim: SimCostConfig = field(default_factory=SimCostConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def schedulers(self) -> list[str]:
        """The scheduler replicas to connect to (`scheduler_addresses`, else
        the one `scheduler_address`; none: a standalone engine)."""
        return scheduler_addresses(self.scheduler_address, self.scheduler_addresses)


@dataclass
class EnginesConfig:
    """How `kvmesh up` starts engines on this machine."""

    # Engines to start. Bounds: >= 0.
    count: int = 2
    backend: Literal["sim", "vllm"] = "sim"
    # First engine's gRPC port; engine i listens on base_port + i. Each
    # base + count - 1 must stay a TCP port (<= 65535).
    base_port: int = 50100
    # Engine i's metrics on metrics_base_port + i; 0 = off.
    metrics_base_port: int = 9200
    # Engine i's OpenAI HTTP endpoint on http_base_port + i; 0 = off.
    http_base_port: int = 0
    # Template every engine starts from (backend, block size, cost model...).
    template: EngineConfig = field(default_factory=EngineConfig)
