"""Scheduler statistics from vLLM's stat-logger hook.

vLLM calls `record()` on the event loop (AsyncLLM's output handler) after
every engine step with the core's SchedulerStats: running and waiting
requests, KV usage and per-step prefix-cache queries/hits; and its
IterationStats, which go on to the engine's metrics (`StepObserver`) the
way vLLM's own PrometheusStatLogger reads them: preemptions, tokens per
step (prompt tokens computed + generated), inter-token latencies, and each
finished request's queue / prefill / decode time. Step time: the
scheduler's `iteration_details.elapsed_ms` when vLLM reports it, else the
wall time between two steps of a batch that was not empty (the engine ran
continuously in between).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.engine.backend import RequestPhases, StepObserver
from services.engine.step_speed import StepSpeed

__all__ = ["EngineStats", "forward_iteration", "make_stat_logger_factory"]


@dataclass
class EngineStats:
    """The latest scheduler view plus cumulative prefix-cache counters."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found cached
    steps: int = 0
    preemptions: int = 0
    observer: StepObserver | None = None  # the engine's metrics (set_step_observer)
    last_step_at: float | None = None     # iteration timestamp of the last step with a batch
    speed: StepSpeed = field(default_factory=StepSpeed)  # measured step speed for the load report


def forward_iteration(stats: EngineStats, scheduler_stats: Any, iteration_stats: Any, busy_before: bool) -> None:
    """One step's IterationStats -> the observer (no vLLM import: read by
    attribute, as vLLM's own PrometheusStatLogger reads them)."""
    observer = stats.observer
    at = getattr(iteration_stats, "iteration_timestamp", None)
    details = getattr(scheduler_stats, "iteration_details", None) if scheduler_stats is not None else None
    seconds: float | None = None
    if details is not None:
        seconds = details.elapsed_ms / 1000.0
    elif busy_before and at is not None and stats.last_step_at is not None:
        seconds = at - stats.last_step_at
    prompt_stats = getattr(iteration_stats, "prompt_token_stats", None)
    computed = prompt_stats.computed if prompt_stats is not None else iteration_stats.num_prompt_tokens
    # sequences decoded ~ tokens generated (one each, no speculative decoding here)
    stats.speed.observe(seconds, computed, iteration_stats.num_generation_tokens)
    if observer is None:
        stats.last_step_at = at if stats.running else None
        return
    observer.step(seconds, computed + iteration_stats.num_generation_tokens,
                  getattr(iteration_stats, "num_preempted_reqs", 0))
    for gap in iteration_stats.inter_token_latencies_iter:
        observer.inter_token(gap)
    for done in iteration_stats.finished_requests:
        observer.request_phases(RequestPhases(done.queued_time, done.prefill_time, done.decode_time))
    stats.last_step_at = at if stats.running else None


def make_stat_logger_factory(
    stats: EngineStats, on_record: Callable[[], None]
) -> Callable[[Any, int], Any]:
    """A vLLM StatLoggerFactory writing into `stats` (imports vLLM: call
    only once vLLM is loaded)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _KvmeshStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            busy_before = stats.running > 0
            if scheduler_stats is not None:
                stats.running = scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs + getattr(
                    scheduler_stats, "num_skipped_waiting_reqs", 0
                )
                stats.kv_usage = scheduler_stats.kv_cache_usage
                prefix = scheduler_stats.prefix_cache_stats
                if prefix is not None:
                    stats.prefix_queries += prefix.queries
                    stats.prefix_hits += prefix.hits
                stats.steps += 1
            if iteration_stats is not None:
                stats.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)
                forward_iteration(stats, scheduler_stats, iteration_stats, busy_before)
            on_record()

        def log_engine_initialized(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int = 0) -> Any:
        return _KvmeshStatLogger(vllm_config, engine_index)

    return factory
