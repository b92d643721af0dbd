"""`kvmesh admin`: the scheduler's runtime knobs (kvmesh.v1.Admin).

    kvmesh admin drain-engine ID [--move]   no new requests on ID (--move: hand its running ones over)
    kvmesh admin undrain-engine ID          ID takes new requests again
    kvmesh admin pause P2 | resume P2       stop / restart dispatching a class (P0, P1, P2)
    kvmesh admin policy NAME                change the placement policy
    kvmesh admin state                      paused classes, drained engines, the policy

The token: `--token-file FILE` (kvmesh up writes RUN_DIR/admin-token), else
$KVMESH_ADMIN_TOKEN. The scheduler: `--scheduler HOST:PORT`, else the
config's (`--config`, e.g. RUN_DIR/kvmesh.resolved.yaml); with mesh TLS on,
the config's `admin` certificate. Exit 0 done, 1 refused or failed, 2 usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc

from services.common.config import ConfigError, MeshConfig
from services.common.proto.kvmesh.v1 import admin_pb2, admin_pb2_grpc
from services.common.secret_file import read_secret_file

from .connect import scheduler_address, scheduler_channel

__all__ = ["add_parser", "parse_priority", "read_token", "run"]

_TIMEOUT_SECONDS = 10.0


def parse_priority(text: str) -> int:
    """"P2", "p2" or "2" -> 2."""
    value = text.strip().upper().removeprefix("P")
    if value not in ("0", "1", "2"):
        raise argparse.ArgumentTypeError(f"a priority class is P0, P1 or P2, got {text!r}")
    return int(value)


def read_token(token_file: str | None) -> str:
    if token_file:
        return read_secret_file(token_file, "--token-file")
    token = os.environ.get("KVMESH_ADMIN_TOKEN", "").strip()
    if not token:
        raise ConfigError("no admin token: pass --token-file FILE (kvmesh up writes RUN_DIR/admin-token) "
                          "or set KVMESH_ADMIN_TOKEN")
    return token


def add_parser(sub: Any, run_with_config: Callable[[argparse.Namespace], None]) -> None:
    p = sub.add_parser("admin", help="runtime knobs: drain engines, pause classes, change the policy",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--scheduler", metavar="HOST:PORT", help="the scheduler (default: from the config)")
    p.add_argument("--token-file", help="file holding the admin token (default: $KVMESH_ADMIN_TOKEN)")
    p.set_defaults(func=run_with_config)
    verbs = p.add_subparsers(dest="admin_command", required=True)
    drain = verbs.add_parser("drain-engine", help="place no new request on an engine")
    drain.add_argument("engine_id")
    drain.add_argument("--move", action="store_true",
                       help="also hand its running requests over (they continue on other engines)")
    verbs.add_parser("undrain-engine", help="let a drained engine take new requests").add_argument("engine_id")
    verbs.add_parser("pause", help="dispatch nothing of a class (its requests wait queued)").add_argument(
        "priority", type=parse_priority, metavar="P0|P1|P2")
    verbs.add_parser("resume", help="dispatch a paused class again").add_argument(
        "priority", type=parse_priority, metavar="P0|P1|P2")
    verbs.add_parser("policy", help="change the placement policy").add_argument("name")
    verbs.add_parser("state", help="paused classes, drained engines, the policy")


def _call(stub: admin_pb2_grpc.AdminStub, ns: argparse.Namespace, metadata: Any) -> Any:
    kw = {"metadata": metadata, "timeout": _TIMEOUT_SECONDS}
    verb = ns.admin_command
    if verb == "drain-engine":
        return stub.DrainEngine(admin_pb2.DrainEngineRequest(engine_id=ns.engine_id, move_running=ns.move), **kw)
    if verb == "undrain-engine":
        return stub.UndrainEngine(admin_pb2.UndrainEngineRequest(engine_id=ns.engine_id), **kw)
    if verb == "pause":
        return stub.PauseClass(admin_pb2.ClassRequest(priority=ns.priority), **kw)
    if verb == "resume":
        return stub.ResumeClass(admin_pb2.ClassRequest(priority=ns.priority), **kw)
    if verb == "policy":
        return stub.SetPlacementPolicy(admin_pb2.SetPlacementPolicyRequest(policy=ns.name), **kw)
    return stub.GetAdminState(admin_pb2.GetAdminStateRequest(), **kw)


def describe(state: admin_pb2.AdminState) -> str:
    paused = ", ".join(f"P{p}" for p in state.paused_priorities) or "none"
    drained = ", ".join(state.drained_engines) or "none"
    return (f"policy {state.policy} (known: {', '.join(state.policies)}); paused: {paused}; "
            f"drained engines: {drained}")


def run(config: MeshConfig, ns: argparse.Namespace) -> int:
    token = read_token(ns.token_file)
    address = scheduler_address(config, ns.scheduler)
    with scheduler_channel(config, address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            reply = _call(stub, ns, (("authorization", f"Bearer {token}"),))
        except grpc.RpcError as err:
            code = err.code().name if hasattr(err, "code") else "ERROR"
            details = err.details() if hasattr(err, "details") else str(err)
            print(f"kvmesh admin: {address}: {code}: {details}", file=sys.stderr)
            return 1
    if isinstance(reply, admin_pb2.AdminState):
        print(describe(reply))
    else:
        print(reply.message + ("" if reply.changed else " (it was so already)"))
        print(describe(reply.state))
    return 0
