"""The benchmark's PNG chart. With matplotlib (the `bench`/`test` extra):
TTFT CDF per class, e2e CDF, TTFT p50/p90/p99 bars, and completions over
time. Without it, a plain bar chart of TTFT p50/p90/p99 per class drawn by
hand (zlib + the PNG format), so a chart is always written."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

from services.bench.stats import RequestResult, class_label

__all__ = ["write_chart"]


def write_chart(path: Path, results: list[RequestResult], summary: dict[str, Any], title: str) -> str:
    """Write the chart; returns which renderer drew it ("matplotlib" or "plain")."""
    try:
        import matplotlib  # optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plain_png(path, summary)
        return "plain"
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    classes = sorted({class_label(r.priority) for r in results})
    for name in classes:
        ttfts = sorted(r.ttft for r in results if r.ok and r.ttft is not None and class_label(r.priority) == name)
        e2es = sorted(r.e2e for r in results if r.ok and r.e2e is not None and class_label(r.priority) == name)
        if ttfts:
            axes[0][0].plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
        if e2es:
            axes[0][1].plot(e2es, [(i + 1) / len(e2es) for i in range(len(e2es))], label=name)
    axes[0][0].set(title="TTFT CDF", xlabel="seconds", ylabel="fraction")
    axes[0][1].set(title="end-to-end latency CDF", xlabel="seconds")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if classes:
            ax.legend()
    names = list(summary["classes"])
    for k, p in enumerate(("p50", "p90", "p99")):
        vals = [(summary["classes"][n]["ttft_s"].get(p) or 0.0) * 1000 for n in names]
        axes[1][0].bar([i + (k - 1) * 0.27 for i in range(len(names))], vals, width=0.27, label=p)
    axes[1][0].set_xticks(range(len(names)), names)
    axes[1][0].set(title="TTFT by class", ylabel="ms")
    axes[1][0].legend()
    ends = sorted(r.start + (r.e2e or 0.0) for r in results if r.ok)
    if ends:
        axes[1][1].plot(ends, range(1, len(ends) + 1))
    axes[1][1].set(title="completed requests over time", xlabel="seconds", ylabel="requests")
    axes[1][1].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return "matplotlib"


def _plain_png(path: Path, summary: dict[str, Any], width: int = 480, height: int = 240) -> None:
    """Grouped bars (p50, p90, p99 TTFT) per class on white, no text."""
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    names = list(summary["classes"])
    colors = [(66, 133, 244), (251, 188, 5), (234, 67, 53)]
    values = [[summary["classes"][n]["ttft_s"].get(p) or 0.0 for p in ("p50", "p90", "p99")] for n in names]
    top = max((v for row in values for v in row), default=0.0) or 1.0
    slot = width // max(1, len(names))
    bar = max(2, slot // 4)
    for i, row in enumerate(values):
        for k, v in enumerate(row):
            h = int((height - 20) * v / top)
            x0 = i * slot + bar // 2 + k * bar
            for y in range(height - 10 - h, height - 10):
                for x in range(x0, min(width, x0 + bar - 1)):
                    pixels[y][x] = colors[k]
    raw = b"".join(b"\x00" + bytes(c for px in line for c in px) for line in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    path.write_bytes(png)
