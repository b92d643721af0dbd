#!/usr/bin/env bash
# The virtual environment every other Python step installs into, with a
# current pip. Idempotent: an existing venv is kept.
#
#   python-env.sh            make $VENV (if missing) and upgrade pip
#   python-env.sh --check    the venv's Python runs and meets requires-python
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"

check() {
  [ -x "$VENV/bin/python" ] || die "no venv at $VENV"
  "$VENV/bin/python" scripts/install/requirements.py python-ok || die "venv Python does not meet requires-python"
  say "ok ($("$VENV/bin/python" --version))"
}

case "${1:-}" in
  --check) check; exit 0 ;;
  "") ;;
  *) die "usage: python-env.sh [--check]" ;;
esac
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
check
