"""`kvmesh top`'s screen: a pure function of one `Frame` (top_data.py) to a
rich renderable, so tests check what is shown without a terminal."""

from __future__ import annotations

import time

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .top_data import Frame

__all__ = ["render"]

_STATUS_STYLE = {"serving": "green", "drained": "yellow", "draining": "yellow", "stale": "red",
                 "not serving": "red"}


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1),
                 show_edge=False)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _engines(frame: Frame) -> Table:
    table = _table("Engines")
    for name in ("engine", "state", "KV used", "running", "waiting", "tokens/s", "health"):
        table.add_column(name, justify="left" if name in ("engine", "state", "health") else "right", no_wrap=True)
    for e in frame.engines:
        table.add_row(e.engine_id, Text(e.status, style=_STATUS_STYLE.get(e.status, "")),
                      f"{e.kv_used * 100:.0f}%", str(e.running), str(e.waiting), _rate(e.tokens_per_second),
                      Text(e.health, style="green" if e.health == "ok" else "yellow"))
    if not frame.engines:
        table.add_row("(none registered)", "", "", "", "", "", "")
    return table


def _queues(frame: Frame) -> Table:
    table = _table("Queues by class")
    for name in ("class", "queued", "oldest", "dispatch"):
        table.add_column(name, justify="left" if name in ("class", "dispatch") else "right", no_wrap=True)
    for q in frame.queues:
        table.add_row(f"P{q.priority}" + (" batch" if q.batch else ""), str(q.queued), f"{q.oldest_wait_seconds:.1f} s",
                      Text("PAUSED", style="bold yellow") if q.paused else Text("on", style="green"))
    return table


def _gateways(frame: Frame) -> Table:
    table = _table("Gateways")
    for name in ("gateway", "streams", "done/s", "errors"):
        table.add_column(name, justify="left" if name == "gateway" else "right", no_wrap=True)
    for g in frame.gateways:
        table.add_row(g.name, _count(g.open_streams), _rate(g.requests_per_second), _count(g.rejections))
    if not frame.gateways:
        table.add_row("(no metrics port known)", "", "", "")
    return table


def _rejections(frame: Frame) -> Table:
    table = _table("Rejections")
    table.add_column("where  reason", no_wrap=True)
    table.add_column("count", justify="right", no_wrap=True)
    for reason, count in sorted(frame.rejections.items()):
        table.add_row(reason, str(count))
    if not frame.rejections:
        table.add_row("(none)", "0")
    return table


def _deadlines(frame: Frame) -> Table:
    table = _table("Deadlines from live p95 (GetState)")
    for name in ("model", "class", "kind", "p95", "samples", "deadline", "source"):
        table.add_column(name, justify="left" if name in ("model", "class", "kind", "source") else "right",
                         no_wrap=True)
    for d in frame.deadlines:
        table.add_row(d.model, f"P{d.priority}", d.kind, f"{d.p95_seconds * 1000:.0f} ms" if d.samples else "-",
                      str(d.samples), f"{d.deadline_seconds:.2f} s",
                      Text(d.source, style="green" if d.source == "derived" else "dim"))
    return table


def _scaling(frame: Frame) -> Table:
    table = _table("Scaling (desired engines = serving + spares)")
    for name in ("model", "desired", "now", "spares", "why"):
        table.add_column(name, justify="right" if name in ("desired", "now", "spares") else "left",
                         no_wrap=name != "why")
    for m in frame.scaling:
        style = "yellow" if m.desired != m.current else "green"
        model = m.model + ("" if m.autoscaled else " (not autoscaled)")
        table.add_row(model, Text(str(m.desired), style=style), str(m.current), str(m.spares), m.reason)
    return table


# Narrower than this, the queue, gateway and rejection tables stack.
_SIDE_BY_SIDE_COLUMNS = 110


def render(frame: Frame, width: int = 160) -> RenderableType:
    """The whole screen for `frame` on a terminal `width` columns wide."""
    clock = time.strftime("%H:%M:%S", time.localtime(frame.taken_at))
    header = Text.assemble(
        ("kvmesh top", "bold"), f"  {clock}  scheduler {frame.scheduler}",
        f" (replica {frame.replica}, hears {frame.peers} other{'s' * (frame.peers != 1)})" if frame.replica else "",
        "  policy ",
        (frame.policy, "bold cyan"), f"  leases {frame.leases}")
    tables = [_queues(frame), _gateways(frame), _rejections(frame)]
    parts: list[RenderableType] = [header, _engines(frame)]
    if width >= _SIDE_BY_SIDE_COLUMNS:
        middle = Table.grid(padding=(0, 3))
        middle.add_row(*tables)
        parts.append(middle)
    else:
        parts.extend(tables)
    if frame.scaling:
        parts.append(_scaling(frame))
    if frame.deadlines:
        parts.append(_deadlines(frame))
    for problem in frame.problems:
        parts.append(Text(f"! {problem}", style="red"))
    return Group(*parts)
