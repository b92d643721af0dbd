"""vLLM-named Prometheus metrics, so dashboards and routers built for vLLM
read kvmesh engines unchanged, plus kvmesh's own engine series
(`kvmesh_engine_*`: the batch gate of services/engine/batch_gate.py).

prometheus_client keeps the ':' of vLLM's names and, like vLLM itself (which
uses prometheus_client too), exposes counters with the `_total` suffix:
`vllm:prompt_tokens_total`, `vllm:prefix_cache_hits_total`, ... Every series
carries `model_name`, as vLLM's do. Gauges are read from the backend at
scrape time. Own `CollectorRegistry`, never the global one (several engines
may share one test process).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.common.finish_reason import FinishReason
from services.engine.backend import GenerationOutput, LoadSnapshot, RequestPhases

__all__ = ["EngineMetrics"]

# vLLM's own TTFT buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's (vllm/v1/metrics/buckets.py): inter-token latency, tokens per step.
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# One batch step: a few ms (a decode on a GPU) to seconds (a long prefill chunk on CPU).
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)
# vLLM's request_latency buckets, shared by e2e, queue, prefill and decode time.
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    def __init__(self, model_name: str, engine_id: str, load: Callable[[], LoadSnapshot]) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name", "engine"]
        values = [model_name, engine_id]
        self._read_load = load
        self._scrape_load: LoadSnapshot | None = None  # one snapshot per /metrics scrape

        def gauge(name: str, doc: str, fn: Callable[[LoadSnapshot], float]) -> None:
            Gauge(name, doc, labels, registry=r).labels(*values).set_function(lambda: fn(self._load()))

        gauge("vllm:num_requests_running", "Requests in the running batch.", lambda s: s.running)
        gauge("vllm:num_requests_waiting", "Requests waiting in the engine.", lambda s: s.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = full).",
              lambda s: s.blocks_used / s.blocks_total if s.blocks_total else 0.0)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self._queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self._hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._prompt = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self._generation = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                [*labels, "finished_reason"], registry=r)
        for reason in FinishReason:   # at 0 before the first finish: a board reads 0, not nothing
            self._success.labels(*values, reason.value)
        self._values = values
        self._hang_bound = self._liveness_gauge(r, labels, values)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                               labels, buckets=_TTFT_BUCKETS, registry=r).labels(*values)
        self._held = Gauge("kvmesh_engine_runtime_waiting",
                           "Requests the engine runtime holds back from the backend (classes > P0 "
                           "beyond max_running); vllm:num_requests_waiting counts them too.",
                           labels, registry=r).labels(*values)
        self._over = Gauge("kvmesh_engine_p0_headroom_in_use",
                           "Requests in the backend beyond max_running: P0s using p0_headroom "
                           "(beyond it they wait first in the backend's queue).",
                           labels, registry=r).labels(*values)
        self._p0_over = counter("kvmesh_engine_p0_over_admissions",
                                "P0 requests started while max_running or more requests were in the backend.")
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end.",
                              labels, buckets=_E2E_BUCKETS, registry=r).labels(*values)
        self._add_step_metrics(r, labels, values)
        self._prefix_totals = (0, 0)
        kv = Gauge("kvmesh_engine_kv_blocks", "KV-cache blocks: used (held by running requests), cached "
                   "(full blocks in the prefix cache, free or not), total", [*labels, "state"], registry=r)
        kv.labels(*values, "used").set_function(lambda: self._load().blocks_used)
        kv.labels(*values, "cached").set_function(lambda: self._load().cached_blocks)
        kv.labels(*values, "total").set_function(lambda: self._load().blocks_total)
        self.serving = Gauge("kvmesh_engine_serving", "1 while the engine takes new generations (model loaded, "
                             "not draining or failed), else 0", labels, registry=r).labels(*values)
        self._migrations_out = counter("kvmesh_engine_migrations_out",
                                       "Generations this engine gave up before their end, for another "
                                       "engine to continue: drain, engine failure, fencing")
        self.fenced = Counter("kvmesh_engine_fenced",
                              "Generations ended because the scheduler leases them to no request on this engine "
                              "(orphans of a migration or of a vanished gateway, e.g. after a healed partition).",
                              ["engine"], registry=r)

    def _add_step_metrics(self, r: CollectorRegistry, labels: list[str], values: list[str]) -> None:
        """What the backend reports per step and per finished request
        (`StepObserver`): vLLM's own figures from its stat logger, the sim's
        from its step loop."""
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self._preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                                    labels, registry=r).labels(*values)
        self._itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              _ITL_BUCKETS)
        self._queue_time = histogram("vllm:request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.", _E2E_BUCKETS)
        self._prefill_time = histogram("vllm:request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.", _E2E_BUCKETS)
        self._decode_time = histogram("vllm:request_decode_time_seconds",
                                      "Histogram of time spent in DECODE phase for request.", _E2E_BUCKETS)
        self._iteration_tokens = histogram("vllm:iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.",
                                           _ITERATION_TOKENS_BUCKETS)
        self._step = histogram("kvmesh_engine_step_seconds", "One backend step (batch iteration), its wall time",
                               _STEP_BUCKETS)

    # ---------------------------------------------------------------- StepObserver

    def step(self, seconds: float | None, tokens: int, preempted: int) -> None:
        """One batch iteration: its time (None if the backend could not tell),
        tokens computed (prefill + decode) and requests preempted."""
        if seconds is not None:
            self._step.observe(max(0.0, seconds))
        self._iteration_tokens.observe(tokens)
        if preempted:
            self._preemptions.inc(preempted)

    def inter_token(self, seconds: float) -> None:
        """One request's gap since its previous token (once per request per step)."""
        self._itl.observe(max(0.0, seconds))

    def request_phases(self, phases: RequestPhases) -> None:
        self._queue_time.observe(max(0.0, phases.queued))
        self._prefill_time.observe(max(0.0, phases.prefill))
        self._decode_time.observe(max(0.0, phases.decode))

    @staticmethod
    def _liveness_gauge(r: CollectorRegistry, labels: list[str], values: list[str]) -> Gauge:
        """Registered with the rest (the metric catalogue reads the registry);
        it reads the runtime's watch once `watch_hang_bound` names it."""
        return Gauge("kvmesh_engine_hang_bound_seconds",
                     "Seconds without progress after which the busy backend counts as hung "
                     "(max(floor, k x p99 step interval); a still-running one gets busy_multiple x)",
                     labels, registry=r).labels(*values)

    def watch_hang_bound(self, bound: Callable[[], float]) -> None:
        """The liveness watch's current hang bound, read at scrape time: it
        follows the recent step intervals (liveness.py), so an operator -- or a
        test waiting for a hang to be declared -- reads how long that takes now."""
        self._hang_bound.set_function(bound)

    def migrated_out(self, generations: int = 1) -> None:
        self._migrations_out.inc(generations)

    def _load(self) -> LoadSnapshot:
        """The backend's load: during a scrape (`exposition`) the gauges
        that show it share one snapshot; otherwise read now."""
        return self._scrape_load if self._scrape_load is not None else self._read_load()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(max(0.0, seconds))

    def generated(self, tokens: int) -> None:
        self._generation.inc(tokens)

    def finished(self, out: GenerationOutput, seconds: float) -> None:
        hits = min(out.cached_tokens, out.prompt_tokens) if out.prompt_tokens else 0
        self._prompt.inc(out.prompt_tokens)
        self._queries.inc(out.prompt_tokens)
        self._hits.inc(hits)
        self._prefix_totals = (self._prefix_totals[0] + out.prompt_tokens, self._prefix_totals[1] + hits)
        self._success.labels(*self._values, out.finish_reason or "error").inc()
        self._e2e.observe(max(0.0, seconds))

    def prefix_cache_totals(self) -> tuple[int, int]:
        """(prompt tokens looked up, found) in the prefix cache since start:
        what the load report tells the scheduler."""
        return self._prefix_totals

    def batch_gate(self, held: int, over_max_running: int) -> None:
        self._held.set(held)
        self._over.set(over_max_running)

    def p0_over_admitted(self) -> None:
        self._p0_over.inc()

    def exposition(self) -> bytes:
        self._scrape_load = self._read_load()
        try:
            return generate_latest(self.registry)
        finally:
            self._scrape_load = None

