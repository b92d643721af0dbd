"""Results as JSON and as a text table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from services.bench.stats import RequestResult

__all__ = ["format_summary", "write_json"]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _trip(block: dict[str, Any], key: str) -> str:
    """p50/p90/p99 of one latency of a block, in ms."""
    return "/".join(_ms(block[key].get(p)) for p in ("p50", "p90", "p99"))


def _preempted(figures: dict[str, dict[str, float]] | None, name: str) -> list[str]:
    """The preemption column (`kvmesh bench --scheduler`): preempted /
    requeued / seconds lost of one class, summed for "all"."""
    if figures is None:
        return []
    rows = list(figures.values()) if name == "all" else [figures[name]] if name in figures else []
    if not rows:
        return ["-"]
    total = {k: sum(r.get(k, 0.0) for r in rows) for k in ("preemptions", "requeued", "seconds_lost")}
    return [f"{total['preemptions']:.0f} / {total['requeued']:.0f} / {total['seconds_lost']:.1f}"]


def format_summary(summary: dict[str, Any]) -> str:
    """One row per class plus "all": TTFT / inter-token / e2e percentiles (ms),
    throughput, prefix hit rate and rejections; with the scheduler's figures
    (`scheduler_classes`), preemptions / re-queues / seconds lost too."""
    head = ["class", "ok/sent", "rej", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "e2e p50/p90/p99 ms",
            "req/s", "out tok/s", "hit rate"]
    figures = summary.get("scheduler_classes")
    if figures is not None:
        head.append("preempted / requeued / s lost")
    rows = [head, ["---"] * len(head)]
    blocks = [("all", summary["overall"]), *summary["classes"].items()]
    for name, b in blocks:
        rows.append([
            name, f"{b['ok']}/{b['requests']}", str(b["rejected"]),
            _trip(b, "ttft_s"), _trip(b, "itl_s"), _trip(b, "e2e_s"),
            f"{b['requests_per_s']:.2f}" if b["requests_per_s"] is not None else "-",
            f"{b['output_tokens_per_s']:.0f}" if b["output_tokens_per_s"] is not None else "-",
            f"{b['prefix_hit_rate']:.1%}" if b["prefix_hit_rate"] is not None else "-",
            *_preempted(figures, name),
        ])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def write_json(path: Path, meta: dict[str, Any], summary: dict[str, Any], results: list[RequestResult]) -> None:
    keep = [f.name for f in dataclasses.fields(RequestResult) if f.name not in ("chunk_gaps", "messages")]
    doc = {"meta": meta, "summary": summary, "requests": [{k: getattr(r, k) for k in keep} for r in results]}
    path.write_text(json.dumps(doc, indent=1, default=str))
