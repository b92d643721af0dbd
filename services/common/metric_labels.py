"""Label values shared by every service's metrics, so one dashboard query
matches the gateway's, the scheduler's and the engines' series alike."""

from __future__ import annotations

__all__ = ["PRIORITY_LABELS", "priority_label"]

# Priority classes as metric labels: "P0" (interactive) .. "P2" (batch), the
# names the README, `kvmesh bench` and the dashboards use.
PRIORITY_LABELS = ("P0", "P1", "P2")


def priority_label(priority: int) -> str:
    """0 -> "P0"; a value outside 0..2 keeps its number ("P7") rather than
    raising: a label must never fail a request."""
    return f"P{int(priority)}"
