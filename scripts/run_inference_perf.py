"""A load generator nobody here wrote against kvmesh: `inference-perf`
(PyPI inference-perf==0.7.0, kubernetes-sigs; installed by
scripts/setup_peers.sh into .venv-peers, Python 3.12) drives its own
`shared_prefix` workload through Envoy's OpenAI endpoint of a sim mesh
(engines calibrated as Llama-3-8B on an A100, config/sim-profiles/), offline,
with the local tokenizer directory. Prints inference-perf's own summary
figures and keeps its report files (--out).

    .venv/bin/python scripts/run_inference_perf.py            # ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.config import load_config
from services.engine.sim.profiles import apply_profile, load_profile
from services.launcher.mesh import Mesh, MeshOptions

MODEL = "tiny-llama"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speed-factor", type=float, default=4.0)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--duration", type=int, default=40)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "inference-perf"))
    args = p.parse_args(argv)
    binary = ROOT / ".venv-peers" / "bin" / "inference-perf"
    if not binary.exists():
        print("run scripts/setup_peers.sh first (.venv-peers/bin/inference-perf is missing)", file=sys.stderr)
        return 2
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    apply_profile(config, load_profile(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"),
                  speed_factor=args.speed_factor)
    config.scheduler.metrics_port = 0
    config.gateway.metrics_port = 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvmesh-iperf-") as tmp:
        mesh = Mesh(config, MeshOptions(engines=args.engines, backend="sim", model=MODEL, free_ports=True,
                                        run_dir=Path(tmp)))
        mesh.start()
        try:
            cfg = {
                "api": {"type": "chat", "streaming": True},
                "data": {"type": "shared_prefix", "shared_prefix": {
                    "num_groups": args.groups, "num_prompts_per_group": 16,
                    "system_prompt_len": args.system_tokens, "question_len": 50, "output_len": 16}},
                "load": {"type": "poisson", "stages": [{"rate": args.rate, "duration": args.duration}],
                         "num_workers": 2},
                "server": {"type": "vllm", "model_name": MODEL, "base_url": mesh.endpoints.public_http,
                           "ignore_eos": True, "api_key": mesh.api_key},
                "tokenizer": {"pretrained_model_name_or_path": str(ROOT / ".models" / MODEL)},
                "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
                "storage": {"local_storage": {"path": str(out)}},
            }
            cfg_path = Path(tmp) / "inference-perf.yaml"
            cfg_path.write_text(yaml.safe_dump(cfg))
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            proc = subprocess.run([str(binary), "--config_file", str(cfg_path)], env=env, cwd=tmp,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900, check=False)
            (out / "inference-perf.log").write_bytes(proc.stdout)
            print(proc.stdout.decode(errors="replace")[-3000:])
        finally:
            mesh.stop_all()
    for report in sorted(out.glob("*summary*.json")):
        data = json.loads(report.read_text())
        print(f"\n== {report.name}")
        print(json.dumps(data, indent=1)[:4000])
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
