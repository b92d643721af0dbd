"""Chaos run: load through Envoy while engines, their cores, the scheduler and
gateways are killed, hung and rolled at random. Prints what clients saw;
exits 1 if any request was lost.

    .venv/bin/python scripts/chaos.py --seconds 60 --seed 7
    .venv/bin/python scripts/chaos.py --faults gateway-roll,gateway-kill --seconds 90
    .venv/bin/python scripts/chaos.py --schedulers 3 --faults scheduler-kill --every 20 --seconds 300 \
        --priority-mix 0.2,0.3,0.5 --paired
    sudo .venv/bin/python scripts/chaos.py --netns --faults partition --seconds 60 --seed 1

The mesh: scheduler, 2 engines (sim by default; `--backend vllm`), 2
gateways, Envoy -- real processes on free loopback ports, in a temporary run
directory, restarted as `kvmesh up` restarts them (its `Restarts` policy:
the scheduler and engines come back on their own). Faults, one at a time,
chosen with the seeded RNG every few seconds from `--faults`:

- engine-kill: SIGKILL of an engine service, restarted a moment later
  (its streams migrate mid-answer);
- scheduler-kill: SIGKILL of the scheduler, restarted as `kvmesh up` does
  (gateways re-admit queued requests and re-attach running ones); with
  `--schedulers N` (N active replicas, README "Several schedulers") a
  replica drawn with the seeded RNG, its requests moving to the others at
  once. The fault ends when every engine reports to the restarted one;
- scheduler-roll (only when named, and with `--schedulers` 2 or more): a
  rolling restart of the replicas -- each SIGTERMed (hands its queued
  requests over, its running leases re-attach elsewhere), exits, comes back,
  has every engine reporting to it, then the next
  (scripts/chaoslib/schedulers.py);
- scheduler-stop (only when named, and with `--schedulers` 2 or more):
  SIGSTOP of a replica for `--hang-seconds`, then SIGCONT -- a replica gone
  silent, as a host cut off without a reset is;
- core-kill: SIGKILL of an engine's `VLLM::EngineCore` process (vLLM only:
  the engine fails as a whole, its streams migrate, it exits and restarts).
  The sim has no core process and its crash hook is in-process only: the
  fault is skipped with a message;
- hang: SIGSTOP for `--hang-seconds`, then SIGCONT, of an engine's
  `EngineCore` (vLLM: the engine's hang detection fails it over) or of the
  sim engine process itself (a frozen host: the gateways' keepalive ends its
  streams and they migrate);
- gateway-roll: a rolling restart of both gateways (`Mesh.rolling_restart`:
  each drains on SIGTERM -- not ready, Envoy takes it out, its streams
  finish -- exits, comes back, is in rotation again before the next);
- gateway-kill: SIGKILL of a gateway, restarted a moment later. Its
  clients' streams break mid-answer; each client re-sends the same request
  with `Last-Event-ID: <the last SSE event id it got>` and appends only the
  events after it (what a browser's EventSource does). Without server-side
  resume the re-sent request starts over: the run then shows those streams
  as lost (text repeated), the honest result.

`--netns` (root only): the same load and accounting on the namespace
tests' mesh (tests/netns/: every service, Envoy and the clients on hosts of
their own -- Linux network namespaces on one bridge, with the harness's
safety rules), with faults partition (a random engine or gateway host cut
off silently for 3-10 s, then healed), engine-kill, gateway-kill,
scheduler-kill and hang (scripts/chaoslib/netns.py). Clients there also
resume a stream that stalls (no byte, not even a heartbeat, for 4 s).

`--every S`: a fault every S seconds (the first after S/2) instead of one
every 1-3 s. `--priority-mix 0.2,0.3,0.5`: each distinct request is sent
with an X-Priority drawn from these P0/P1/P2 weights (a mixed-priority
load); first-token times are reported per class. `--paired`: the same load
(same requests, same clients' order, as long) also runs without faults on
the same mesh, half of it before the run with faults and half after (so
drift over the run weighs on both alike), and the P0 TTFT p99 of both and
their ratio are printed (scripts/chaoslib/latency.py).

Every answer is checked against an uninterrupted answer to the same request
taken before the chaos (the sim's text is deterministic, like greedy
decoding), so a repeated or missing token counts as lost.

Outcomes: completed (200, finish length/stop, [DONE], text as expected;
"resumed" counts those that needed a Last-Event-ID resume); rejected (an
HTTP status with an OpenAI error body, or an SSE error event before any
text: a definite answer the client can act on, by reason); lost (anything
else: a stream cut that could not be resumed, a wrong text, an error after
text, a timeout). The client is tests/netns/client.py's; the accounting
scripts/chaoslib/outcomes.py; the loopback mesh and its faults
scripts/chaoslib/loopback.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.chaoslib import loopback, netns


def _check_loopback_options(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.netns and (ns.schedulers != 1 or ns.paired or ns.every is not None or ns.priority_mix):
        parser.error("--schedulers, --paired, --every and --priority-mix are loopback options")
    if not 1 <= ns.schedulers <= 8:
        parser.error("--schedulers must be in [1, 8]")
    if "scheduler-roll" in ns.faults.split(",") and ns.schedulers < 2:
        parser.error("scheduler-roll needs --schedulers 2 or more (the one scheduler's drain is its clients' 503)")
    if "scheduler-stop" in ns.faults.split(",") and ns.schedulers < 2:
        parser.error("scheduler-stop needs --schedulers 2 or more (one stopped scheduler is a stall)")
    if ns.every is not None and not 1.0 <= ns.every <= 600:
        parser.error("--every must be in [1, 600]")
    try:
        mix = [float(x) for x in ns.priority_mix.split(",")] if ns.priority_mix else []
    except ValueError:
        mix = [-1.0]
    if mix and (len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0):
        parser.error("--priority-mix takes three non-negative P0,P1,P2 weights, e.g. 0.2,0.3,0.5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run load and faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--netns", action="store_true",
                        help="run on network-namespace hosts (root only); faults: " + ", ".join(netns.FAULTS))
    parser.add_argument("--faults", default="",
                        help=f"comma-separated, of {', '.join(loopback.FAULTS)} (default all; with --netns "
                             f"{', '.join(netns.FAULTS)}, default partition)")
    parser.add_argument("--backend", choices=["sim", "vllm"], default="sim", help="loopback only")
    parser.add_argument("--schedulers", type=int, default=1, help="active scheduler replicas (loopback only)")
    parser.add_argument("--every", type=float, default=None,
                        help="seconds between faults (default: 1-3 s, drawn)")
    parser.add_argument("--priority-mix", default="", help="P0,P1,P2 weights of the requests' X-Priority "
                        "(default: none sent)")
    parser.add_argument("--paired", action="store_true",
                        help="run the same load without faults too (half before, half after) and compare "
                             "(loopback only)")
    parser.add_argument("--hang-seconds", type=float, default=8.0, help="how long `hang` keeps a process stopped")
    parser.add_argument("--concurrency", type=int, default=24, help="concurrent streaming clients")
    parser.add_argument("--distinct", type=int, default=40, help="distinct requests (answers checked)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--max-running", type=int, default=16, help="sim engine batch size")
    parser.add_argument("--speed-factor", type=float, default=None,
                        help="sim cost model speed factor (default 0.5; 4.0 with --netns: ~25 tokens/s a stream, "
                             "so a cut lands mid-answer)")
    parser.add_argument("--run-dir", default="", help="mesh run directory (default: a new temp dir)")
    ns = parser.parse_args()
    known = netns.FAULTS if ns.netns else loopback.FAULTS + loopback.REPLICA_FAULTS
    ns.faults = ns.faults or ("partition" if ns.netns else ",".join(loopback.FAULTS))
    if ns.speed_factor is None:
        ns.speed_factor = 4.0 if ns.netns else 0.5
    if ns.seconds <= 0 or ns.seconds > 3600:
        parser.error("--seconds must be in (0, 3600]")
    unknown = set(ns.faults.split(",")) - set(known)
    if unknown:
        parser.error(f"--faults: unknown {', '.join(sorted(unknown))}; known"
                     f"{' with --netns' if ns.netns else ''}: {', '.join(known)}")
    if not 0 < ns.hang_seconds <= 300:
        parser.error("--hang-seconds must be in (0, 300]")
    if ns.netns and ns.backend != "sim":
        parser.error("--netns runs sim engines only")
    _check_loopback_options(parser, ns)
    try:
        sys.exit(netns.run(ns) if ns.netns else asyncio.run(loopback.run(ns)))
    except KeyboardInterrupt:
        print("chaos: interrupted; the mesh is torn down", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
