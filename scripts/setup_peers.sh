#!/usr/bin/env bash
# Peers for `scripts/bench_peers.py` and the real-client run in BENCHMARKS.md:
# other routers and load generators, installed into their OWN venv
# (.venv-peers) so they never touch kvmesh's .venv. Not part of `make test`.
#
#   smg==1.13.0                                SGLang's gateway (sglang-router's successor)
#   sglang-router==0.3.2, vllm-router==0.1.17  routers over the same sim engines
#   inference-perf==0.7.0                      a load generator nobody here wrote
#
# inference-perf needs Python >= 3.12 (pyenv has 3.12 on our machines), so the
# venv is built on 3.12; both routers ship abi3 wheels that work there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON_PEERS:-}
if [ -z "$PYTHON" ]; then
  for candidate in "$HOME/.pyenv/versions/3.12.1/bin/python3.12" python3.12; do
    if "$candidate" -c "import sys; assert sys.version_info >= (3, 12)" >/dev/null 2>&1; then PYTHON=$candidate; break; fi
  done
fi
[ -n "$PYTHON" ] || { echo "setup_peers: need Python >= 3.12 (set PYTHON_PEERS)" >&2; exit 1; }
VENV=.venv-peers
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet 'smg==1.13.0' 'sglang-router==0.3.2' 'vllm-router==0.1.17' 'inference-perf==0.7.0'
"$VENV/bin/sglang-router" --help >/dev/null 2>&1 || "$VENV/bin/python" -m sglang_router.launch_router --help >/dev/null
"$VENV/bin/vllm-router" --help >/dev/null
"$VENV/bin/smg" --help >/dev/null
"$VENV/bin/inference-perf" --help >/dev/null
echo "setup_peers: done ($VENV)"
