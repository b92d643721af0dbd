"""The one place the scheduler's plugins are registered, by explicit name:
placement filters, scorers and pickers, and the queue's fairness and
ordering policies (services/scheduler/queue_policies.py).

`builtin_registry(config)` builds a fresh registry holding every built-in
plugin (no module-level mutable state); a duplicate name is an error, and so
is looking up a name nobody registered (a `ConfigError` naming the setting
and listing what exists).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from services.common.config import ConfigError, SchedulerConfig

from ..queue_policies import FairnessPolicy, FifoOrdering, OrderingPolicy, RoundRobinTenants
from . import filters, pickers, scorers
from .interfaces import Filter, Picker, Scorer
from .predicted import PredictedTtftPicker

__all__ = ["PluginRegistry", "builtin_registry"]

P = TypeVar("P")


class PluginRegistry:
    """name -> factory for each plugin kind."""

    def __init__(self) -> None:
        self.filters: dict[str, Callable[[], Filter]] = {}
        self.scorers: dict[str, Callable[[], Scorer]] = {}
        self.pickers: dict[str, Callable[[], Picker]] = {}
        self.fairness: dict[str, Callable[[], FairnessPolicy]] = {}
        self.ordering: dict[str, Callable[[], OrderingPolicy]] = {}

    @staticmethod
    def _add(kind: str, table: dict[str, Callable[[], P]], name: str, factory: Callable[[], P]) -> None:
        if not name:
            raise ValueError(f"a {kind} needs a name")
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = factory

    def register_filter(self, name: str, factory: Callable[[], Filter]) -> None:
        self._add("filter", self.filters, name, factory)

    def register_scorer(self, name: str, factory: Callable[[], Scorer]) -> None:
        self._add("scorer", self.scorers, name, factory)

    def register_picker(self, name: str, factory: Callable[[], Picker]) -> None:
        self._add("picker", self.pickers, name, factory)

    def register_fairness(self, name: str, factory: Callable[[], FairnessPolicy]) -> None:
        self._add("fairness policy", self.fairness, name, factory)

    def register_ordering(self, name: str, factory: Callable[[], OrderingPolicy]) -> None:
        self._add("ordering policy", self.ordering, name, factory)

    @staticmethod
    def _make(kind: str, table: dict[str, Callable[[], P]], name: str, where: str) -> P:
        factory = table.get(name)
        if factory is None:
            raise ConfigError(f"{where}: unknown {kind} {name!r}; registered: {sorted(table)}")
        return factory()

    def make_filter(self, name: str, where: str = "policy") -> Filter:
        return self._make("filter", self.filters, name, where)

    def make_scorer(self, name: str, where: str = "policy") -> Scorer:
        return self._make("scorer", self.scorers, name, where)

    def make_picker(self, name: str, where: str = "policy") -> Picker:
        return self._make("picker", self.pickers, name, where)

    def make_fairness(self, name: str, where: str = "scheduler.queue_fairness") -> FairnessPolicy:
        return self._make("fairness policy", self.fairness, name, where)

    def make_ordering(self, name: str, where: str = "scheduler.queue_ordering") -> OrderingPolicy:
        return self._make("ordering policy", self.ordering, name, where)


def builtin_registry(config: SchedulerConfig) -> PluginRegistry:
    """Every built-in plugin under its name; parameters come from `config`."""
    registry = PluginRegistry()
    for f in (
        filters.ModelFilter,
        filters.ServingFilter,
        filters.FreshFilter,
        filters.NotDrainingFilter,
        filters.NotExcludedFilter,
        filters.FitsContextFilter,
        filters.HasRoomFilter,
        filters.LeaseSlotsFilter,
    ):
        registry.register_filter(f.name, f)
    for s in (
        scorers.PrefixScorer,
        scorers.KvUsageScorer,
        scorers.CacheSpreadScorer,
        scorers.LoadScorer,
        scorers.QueueTimeScorer,
        scorers.WeightScorer,
    ):
        registry.register_scorer(s.name, s)
    registry.register_picker(pickers.MaxScorePicker.name, pickers.MaxScorePicker)
    registry.register_picker(pickers.RoundRobinPicker.name, pickers.RoundRobinPicker)
    margin = config.sticky_margin_seconds
    prefill_rate = config.prefill_tokens_per_second
    registry.register_picker(
        pickers.StickyUntilSaturatedPicker.name,
        lambda: pickers.StickyUntilSaturatedPicker(margin, prefill_rate),
    )
    ttft_margin = config.predicted_ttft_margin_seconds
    # Eviction weight 1: a live block pushed out costs its owner one prefill of it,
    # as dear as the same prefill for this request. On the cache_pressure workload it
    # took TTFT p90 from 888 / 1243 ms to 777 / 782 ms and p99 from 2122 / 2593 to
    # 1141 / 1487 ms (two runs; BENCHMARKS.md, "Eviction-aware placement").
    registry.register_picker(
        PredictedTtftPicker.name, lambda: PredictedTtftPicker(prefill_rate, ttft_margin, evict_weight=1.0)
    )
    registry.register_picker(  # without the eviction charge: the A/B baseline
        "predicted_ttft_plain", lambda: PredictedTtftPicker(prefill_rate, ttft_margin, name="predicted_ttft_plain")
    )
    registry.register_fairness(RoundRobinTenants.name, RoundRobinTenants)
    registry.register_ordering(FifoOrdering.name, FifoOrdering)
    return registry
