"""Labelled metric children kept at hand, so a hot path pays a dict lookup
instead of a `labels(...)` call per use.

prometheus_client's `labels(...)` takes the metric's lock, validates and
builds the label tuple and looks the child up: 2-4 us measured here, and a
gateway request made ~20 such calls at its start, first token and end. The
children kept are the very objects `labels` returns, made on their first use
as before (a series still appears with the first event that records it), so
what is recorded -- and /metrics -- is unchanged.

Bounded: past `max_children` a child is looked up as before and not kept
(label values come from closed sets -- routes, classes, configured models,
finish reasons, error codes -- so the bound is a guard, not a policy).
Ownership: one per metrics object, used from its event loop's thread only.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client.metrics import MetricWrapperBase

__all__ = ["LabelCache"]

_M = TypeVar("_M", bound=MetricWrapperBase)


class LabelCache:
    def __init__(self, max_children: int = 4096) -> None:
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        self._max = max_children

    def __call__(self, metric: _M, *labels: str) -> _M:
        """`metric.labels(*labels)`, kept for next time."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            if len(self._children) < self._max:
                self._children[key] = child
        return child  # type: ignore[return-value]  # `labels` returns the metric's own type
