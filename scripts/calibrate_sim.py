"""Derive (and check) the simulator's cost model for one model on one GPU
from the `vidur` simulator's published profiling data.

Source: github.com/microsoft/vidur, data/profiling/compute/a100/meta-llama/
Meta-Llama-3-8B/mlp.csv (commit 7d47513363ec447a741ac5e47241580b47724fbf;
the PyPI wheel `vidur==0.0.26` ships no CSVs). Each row times every linear
op of ONE transformer layer (medians over repeats, milliseconds) at
`num_tokens` tokens in the batch, tensor parallel 1..8. One forward pass over
n tokens at TP 1 is then

    T(n) = emb + 32 x (input_layernorm + attn_pre_proj + attn_rope + attn_post_proj
                       + post_attention_layernorm + mlp_up_proj + mlp_act
                       + mlp_down_proj + 2 x add)

The sim's step cost is  a + p * prefill_tokens + s * decode_sequences
+ c * context_kilotokens  (services/engine/sim/cost_model.py). Fit:
  a, s   least squares of T(n) over n in [1, 128]  (decode batches: memory-bound)
  p      least squares of T(n) - a over n in [128, 512]  (a chunk of prefill)
  c      not in the CSV (vidur's attention.csv is a git-LFS object we cannot
         read): KV bytes per token (2 x 32 layers x 8 KV heads x 128 x 2 B =
         128 KiB) at 1.5 TB/s effective A100-80GB HBM bandwidth (2.04 TB/s peak)
         = 87 us per 1k tokens of context.

    python scripts/calibrate_sim.py --csv /path/to/mlp.csv          # print the fit + reference points
    python scripts/calibrate_sim.py --check                          # sim vs the profile's reference points

`--check` reads config/sim-profiles/llama3-8b-a100.yaml (whose `reference`
block holds T(n) from the CSV) and prints the sim's predicted step time next
to the source's figure; tests/unit/bench/test_sim_profile.py asserts the same.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine.sim.profiles import check_profile, load_profile

OPS = ["input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add", "add"]
LAYERS = 32
DEFAULT_PROFILE = ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"
REFERENCE_N = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 2048]


def forward_ms(csv_path: Path) -> dict[int, float]:
    out = {}
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            if row["num_tensor_parallel_workers"] != "1":
                continue
            layer = sum(float(row[f"time_stats.{op}.median"]) for op in OPS)
            out[int(row["num_tokens"])] = LAYERS * layer + float(row["time_stats.emb.median"])
    return out


def _lstsq(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def fit(t: dict[int, float]) -> dict[str, float]:
    dec = sorted(n for n in t if n <= 128)
    a, s = _lstsq([float(n) for n in dec], [t[n] for n in dec])
    pre = sorted(n for n in t if 128 <= n <= 512)
    p = sum(n * (t[n] - a) for n in pre) / sum(n * n for n in pre)  # through (0, a)
    return {"decode_seconds_per_step": a / 1e3, "decode_seconds_per_sequence": s / 1e3,
            "prefill_seconds_per_token": p / 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, help="vidur's Meta-Llama-3-8B a100 mlp.csv")
    ap.add_argument("--check", action="store_true", help="compare the sim with the profile's reference points")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ns = ap.parse_args(argv)
    if ns.csv:
        t = forward_ms(ns.csv)
        for key, value in fit(t).items():
            print(f"{key}: {value:.7f}")
        print("reference (tokens: ms):")
        for n in REFERENCE_N:
            print(f"  {n}: {t[n]:.3f}")
    if ns.check or not ns.csv:
        rows = check_profile(load_profile(ns.profile))
        print("| step | source ms | sim ms | error |\n| --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r.label} | {r.source_ms:.2f} | {r.sim_ms:.2f} | {r.error:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
