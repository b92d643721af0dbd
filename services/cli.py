"""The `kvmesh` command: each service alone, or the whole mesh on one machine.

    kvmesh up [--engines N] [--autoscale MIN:MAX] [--backend sim|vllm] [--gateways N]   everything, supervised
    kvmesh scheduler | gateway | engine | batch                    one service (multi-host)
    kvmesh engine --engine-id ID --advertise-address HOST:PORT     an engine with a stable id/name
    kvmesh drain --port METRICS_PORT                               drain a local service (preStop)
    kvmesh envoy render                                            topology YAML -> Envoy config
    kvmesh dashboards render                                       Grafana boards + alert rules (deploy/)
    kvmesh key hash KEY                                            SHA-256 for the config's api_keys
    kvmesh admin pause P2 | drain-engine ID | policy NAME | state  the scheduler's runtime knobs
    kvmesh top [--once]                                            a live view of a running mesh
    kvmesh bench --url URL [--workload ...]                        load-test an OpenAI endpoint

Services import lazily so that `kvmesh --help` and the light services do not
pay for importing vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from services.common.config import ConfigError, MeshConfig, load_config
from services.common.config.addresses import split_host_port
from services.common.grpc_server import configure_keepalive
from services.common.service_main import EXIT_SERVICE_FAILED, ServiceFailed

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "config" / "kvmesh.yaml"


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(coro)


def _config(ns: argparse.Namespace) -> MeshConfig:
    path = ns.config or os.environ.get("KVMESH_CONFIG") or DEFAULT_CONFIG
    config = load_config(path)
    # Every server and channel this service process makes keeps alive so.
    configure_keepalive(config.network)
    return config


def _cmd_scheduler(ns: argparse.Namespace) -> None:
    from services.scheduler.server import serve

    config = _config(ns)
    if ns.port is not None:
        config.scheduler.port = ns.port
    if ns.metrics_port is not None:
        config.scheduler.metrics_port = ns.metrics_port
    _run(serve(config))


def _cmd_engine(ns: argparse.Namespace) -> None:
    from services.engine.server import serve

    config = _config(ns)
    engine = config.engine_config(ns.index)
    if ns.engine_id is not None:
        if not ns.engine_id:
            raise ConfigError("--engine-id: must not be empty")
        engine.engine_id = ns.engine_id
    if ns.advertise_address is not None:
        try:
            split_host_port(ns.advertise_address)
        except ValueError as exc:
            raise ConfigError(f"--advertise-address: {exc}") from exc
        engine.advertise_address = ns.advertise_address
    if ns.backend:
        engine.backend = ns.backend
    if ns.model:
        engine.model = ns.model
    _run(serve(config, engine))


def _cmd_gateway(ns: argparse.Namespace) -> None:
    from services.gateway.server import serve

    config = _config(ns)
    if ns.http_port is not None:
        config.gateway.http_port = ns.http_port
    if ns.grpc_port is not None:
        config.gateway.grpc_port = ns.grpc_port
    if ns.metrics_port is not None:
        config.gateway.metrics_port = ns.metrics_port
    _run(serve(config, replica=ns.replica))


def _cmd_batch(ns: argparse.Namespace) -> None:
    from services.batch.server import serve

    config = _config(ns)
    for name in ("port", "metrics_port", "gateway_url", "database"):
        if getattr(ns, name) is not None:
            setattr(config.batch, name, getattr(ns, name))
    _run(serve(config))


def _cmd_up(ns: argparse.Namespace) -> None:
    from services.launcher.up import run_up

    sys.exit(run_up(_config(ns), ns))


def _cmd_envoy(ns: argparse.Namespace) -> None:
    from services.edge.render import main as render_main

    sys.exit(render_main(ns.rest))


def _cmd_dashboards(ns: argparse.Namespace) -> None:
    from services.observability.cli import main as dashboards_main

    sys.exit(dashboards_main(ns.rest, ns.config or os.environ.get("KVMESH_CONFIG")))


def _cmd_drain(ns: argparse.Namespace) -> None:
    from services.common.health_http import request_drain

    drained, message = request_drain(ns.host, ns.port, ns.timeout)
    print(f"kvmesh drain: {message}", file=sys.stdout if drained else sys.stderr)
    sys.exit(0 if drained else 1)


def _cmd_key(ns: argparse.Namespace) -> None:
    print(hashlib.sha256(ns.key.encode()).hexdigest())


def _cmd_admin(ns: argparse.Namespace) -> None:
    from services.ops.admin_cli import run

    sys.exit(run(_config(ns), ns))


def _cmd_top(ns: argparse.Namespace) -> None:
    from services.ops.top_cli import run

    sys.exit(run(_config(ns), ns))


def _cmd_plan(ns: argparse.Namespace) -> None:
    from services.planning.plan_cli import run

    sys.exit(run(_config(ns), ns))


def _add_service_parsers(sub: Any) -> None:
    """One service per process (multi-host, Kubernetes), and `drain`."""
    sch = sub.add_parser("scheduler", help="run the scheduler (one replica)")
    sch.add_argument("--port", type=int,
                     help="gRPC port (default scheduler.port; kvmesh up gives each replica its own)")
    sch.add_argument("--metrics-port", type=int, help="metrics port (default scheduler.metrics_port; 0 = off)")
    sch.set_defaults(func=_cmd_scheduler)

    eng = sub.add_parser("engine", help="run one engine")
    eng.add_argument("--index", type=int, default=0, help="engine index: id and ports derive from it")
    eng.add_argument("--engine-id", help="engine id (default engine-<index>); on Kubernetes the pod name")
    eng.add_argument("--advertise-address", metavar="HOST:PORT",
                     help="address announced to the scheduler for gateways to dial (a DNS name, IPv4 or "
                          "[IPv6], and the gRPC port; config engines.template.advertise_address); "
                          "default: the bind host (a wildcard one: this machine's address) and port")
    eng.add_argument("--backend", choices=["sim", "vllm"])
    eng.add_argument("--model")
    eng.set_defaults(func=_cmd_engine)

    gw = sub.add_parser("gateway", help="run one gateway replica")
    gw.add_argument("--replica", type=int, default=0)
    gw.add_argument("--http-port", type=int)
    gw.add_argument("--grpc-port", type=int)
    gw.add_argument("--metrics-port", type=int)
    gw.set_defaults(func=_cmd_gateway)

    batch = sub.add_parser("batch", help="run the batch service (the Files + Batches API; one per mesh)")
    batch.add_argument("--port", type=int, help="HTTP API port (config batch.port)")
    batch.add_argument("--metrics-port", type=int, help="metrics and probes port (config batch.metrics_port)")
    batch.add_argument("--gateway-url", help="where lines go: http(s)://host:port of a gateway or Envoy "
                                             "(config batch.gateway_url)")
    batch.add_argument("--database", help="its SQLite file (config batch.database)")
    batch.set_defaults(func=_cmd_batch)

    drain = sub.add_parser("drain", help="drain a service on this host: POST /drain to its metrics port "
                                         "and wait (a Kubernetes preStop hook)")
    drain.add_argument("--port", type=int, required=True, help="the service's metrics port")
    drain.add_argument("--host", default="127.0.0.1", help="a loopback address (default 127.0.0.1)")
    drain.add_argument("--timeout", type=float, default=600.0,
                       help="seconds to wait for the drain's answer (default 600; the service bounds its "
                            "drain: engines stop_grace_seconds, gateways drain_seconds, "
                            "batch drain_seconds)")
    drain.set_defaults(func=_cmd_drain)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="A serving mesh for LLMs.")
    parser.add_argument("--config", help=f"mesh config YAML (default {DEFAULT_CONFIG.relative_to(ROOT)})")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Envoy, scheduler, gateways, engines and the batch service on this machine")
    up.add_argument("--engines", type=int, help="number of engines (default from config: 2)")
    up.add_argument("--autoscale", metavar="MIN:MAX",
                    help="follow the scheduler's desired engine count (scheduler.scaling) within MIN..MAX, "
                         "starting and draining engines here; --engines is then the count to start with "
                         "(default MIN; 0 = scale from zero)")
    up.add_argument("--backend", choices=["sim", "vllm"], help="engine backend")
    up.add_argument("--gateways", type=int, default=1, help="gateway replicas behind Envoy")
    up.add_argument("--schedulers", type=int, default=1,
                    help="active scheduler replicas (1-10; each sees every engine, requests spread over them)")
    up.add_argument("--model", help="model name to serve (default: the first in config)")
    up.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"),
                    help="API key to accept (default: $KVMESH_API_KEY, else a generated dev key)")
    up.add_argument("--admin-token", default=os.environ.get("KVMESH_ADMIN_TOKEN"),
                    help="the scheduler's admin token for `kvmesh admin` (default: $KVMESH_ADMIN_TOKEN, "
                         "else one generated for the run and printed)")
    up.add_argument("--no-envoy", action="store_true", help="do not start Envoy")
    up.add_argument("--mesh-tls", action="store_true",
                    help="mutual TLS between the services, with development certificates unless "
                         "mesh_tls.cert_dir names your own (config mesh_tls.enabled)")
    up.set_defaults(func=_cmd_up)

    _add_service_parsers(sub)

    env = sub.add_parser("envoy", help="Envoy config tooling (kvmesh envoy render --help)")
    env.add_argument("rest", nargs=argparse.REMAINDER)
    env.set_defaults(func=_cmd_envoy)

    # Every argument, --help included, goes to `kvmesh dashboards`'s own parser.
    boards = sub.add_parser("dashboards", add_help=False, prefix_chars="\0",
                            help="Grafana boards and alert rules (kvmesh dashboards --help)")
    boards.add_argument("rest", nargs=argparse.REMAINDER)
    boards.set_defaults(func=_cmd_dashboards)

    from services.bench.cli import add_parser as add_bench_parser  # light imports only

    add_bench_parser(sub)

    from services.ops import admin_cli, top_cli  # light imports only

    admin_cli.add_parser(sub, _cmd_admin)
    top_cli.add_parser(sub, _cmd_top)

    from services.planning import plan_cli  # light imports only

    plan_cli.add_parser(sub, _cmd_plan)

    key = sub.add_parser("key", help="API key tooling")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_hash = key_sub.add_parser("hash", help="print the SHA-256 to put in gateway.api_keys or "
                                               "scheduler.admin_keys")
    key_hash.add_argument("key")
    key_hash.set_defaults(func=_cmd_key)
    return parser


def _lean_records() -> None:
    """Log records without what the format never prints: the caller's file
    and line (a stack walk per record), thread and process names (the
    logging HOWTO's "Optimization"). Every service logs a line per request
    (gateway, scheduler placement, engine start: one id followed across
    logs); the scheduler's placement line took 18.8 us of CPU before, 13.5
    after (BENCHMARKS.md, "Third pass")."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # noqa: SLF001 - the HOWTO's documented switch for caller lookup


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    _lean_records()
    try:
        ns.func(ns)
    except ConfigError as exc:
        print(f"kvmesh: config error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ServiceFailed as exc:  # e.g. an engine whose backend died: exit for a restart
        print(f"kvmesh: {exc}", file=sys.stderr)
        sys.exit(EXIT_SERVICE_FAILED)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
