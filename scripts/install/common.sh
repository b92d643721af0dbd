# shellcheck shell=bash
# Sourced by every step in scripts/install/ (never run alone): strict mode,
# the repository root as the working directory, and the venv the steps share.
#
#   KVMESH_HOME  the repository (default: two folders above this file)
#   VENV         the virtual environment (default: .venv inside KVMESH_HOME)
#   PYTHON       the interpreter that makes the venv (default: python3)
set -euo pipefail
KVMESH_HOME=${KVMESH_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
cd "$KVMESH_HOME"
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STEP=$(basename "$0" .sh)

say() { echo "$STEP: $*"; }
die() { echo "$STEP: $*" >&2; exit 1; }
