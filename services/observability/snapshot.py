"""Each board drawn from a Prometheus as one PNG (matplotlib): the panels in
a grid, in the board's order, with their titles, units and legends -- what a
reader without Grafana can look at (artifacts/dashboards/).

The queries are the boards' own, with "All" for every template variable and
`$__rate_interval` given (Grafana's rule: at least four scrape intervals).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.observability.boards import BOARDS
from services.observability.panels import Board, Panel, substitute
from services.observability.prom_api import query_range

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Series", "fetch_panel", "snapshot_boards"]

_COLUMNS = 3
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_UNITS = {"s": "seconds", "ms": "milliseconds", "reqps": "requests / s", "ops": "per second",
          "percentunit": "%", "short": ""}


@dataclass(frozen=True)
class Series:
    legend: str
    times: list[float]
    values: list[float]


def _legend(template: str, labels: dict[str, str], fallback: str) -> str:
    text = _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template).strip()
    return text or fallback


def fetch_panel(prom_url: str, panel: Panel, start: float, end: float, step: float,
                rate_interval: str) -> list[Series]:
    """Every series of the panel's queries over [start, end]."""
    out: list[Series] = []
    for q in panel.queries:
        for s in query_range(prom_url, substitute(q.expr, rate_interval), start, end, step):
            points = [(float(t), float(v)) for t, v in s["values"]]
            points = [(t, v) for t, v in points if math.isfinite(v)]
            if points:
                fallback = ", ".join(f"{k}={v}" for k, v in s["metric"].items() if k != "__name__") or "value"
                out.append(Series(_legend(q.legend, s["metric"], fallback), [t for t, _ in points],
                                  [v for _, v in points]))
    return out


def _draw_panel(ax: Axes, panel: Panel, series: list[Series], start: float, end: float) -> None:
    ax.set_title(panel.title, fontsize=10, loc="left")
    scale = 100.0 if panel.unit == "percentunit" else 1.0
    ax.set_ylabel(_UNITS.get(panel.unit, panel.unit), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    ax.set_xlim(0, end - start)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    for s in series[:12]:
        ax.plot([t - start for t in s.times], [v * scale for v in s.values], label=s.legend, linewidth=1.2)
    if panel.kind == "stat":
        last = "\n".join(f"{s.legend}: {s.values[-1] * scale:.3g}" for s in series[:4])
        ax.text(0.02, 0.92, last, transform=ax.transAxes, fontsize=8, va="top", weight="bold")
    ax.set_xlabel("seconds", fontsize=7)
    ax.legend(fontsize=6, loc="upper right", ncol=2 if len(series) > 6 else 1)


def draw_board(board: Board, prom_url: str, start: float, end: float, rate_interval: str) -> Any:
    """The board as a matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels = board.panels()
    rows = math.ceil(len(panels) / _COLUMNS)
    fig, axes = plt.subplots(rows, _COLUMNS, figsize=(6 * _COLUMNS, 3.3 * rows), squeeze=False)
    step = max(1.0, (end - start) / 300)
    for i, panel in enumerate(panels):
        _draw_panel(axes[i // _COLUMNS][i % _COLUMNS], panel,
                    fetch_panel(prom_url, panel, start, end, step, rate_interval), start, end)
    for j in range(len(panels), rows * _COLUMNS):
        axes[j // _COLUMNS][j % _COLUMNS].axis("off")
    span = f"{datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} + {end - start:.0f} s"
    fig.suptitle(f"{board.title}   ({span}, rate over {rate_interval})", fontsize=13, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    return fig


def snapshot_boards(prom_url: str, out_dir: Path, minutes: float = 10.0, end: float | None = None,
                    rate_interval: str = "1m", boards: tuple[Board, ...] = BOARDS) -> list[Path]:
    """One PNG per board, `out_dir/<uid>.png`, over the `minutes` before `end`."""
    from matplotlib import pyplot as plt

    end = time.time() if end is None else end
    start = end - minutes * 60
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for board in boards:
        fig = draw_board(board, prom_url, start, end, rate_interval)
        path = out_dir / f"{board.uid}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths
