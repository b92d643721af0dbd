#!/usr/bin/env bash
# kvmesh itself, editable (-e) from the repository: its code finds config/,
# envoy/ and web/ beside services/, so the tree stays where it is (the image
# keeps it at /opt/kvmesh). Dependencies come from python-deps.sh (--no-deps).
#
#   kvmesh.sh            install, then check
#   kvmesh.sh --check    `kvmesh --help` runs and imports this tree's code
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"

check() {
  [ -x "$VENV/bin/kvmesh" ] || die "no kvmesh entry point in $VENV/bin"
  "$VENV/bin/kvmesh" --help >/dev/null || die "kvmesh --help failed"
  say "ok"
}

case "${1:-}" in
  --check) check; exit 0 ;;
  "") ;;
  *) die "usage: kvmesh.sh [--check]" ;;
esac
"$VENV/bin/pip" install --quiet --no-deps -e .
check
