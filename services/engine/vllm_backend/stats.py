"""Scheduler statistics from vLLM's stat-logger hook.

vLLM calls `record()` on the event loop (AsyncLLM's output handler) after
every engine step with the core's SchedulerStats: running and waiting
requests, KV usage and per-step prefix-cache queries/hits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineStats", "make_stat_logger_factory"]


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
            on_record()

        def log_engine_initialized(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int = 0) -> Any:
        return _KvmeshStatLogger(vllm_config, engine_index)

    return factory
