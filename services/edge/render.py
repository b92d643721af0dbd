"""Topology YAML -> Envoy v3 bootstrap YAML (static resources, no xDS).

    kvmesh envoy render [--topology F] [--out F]   one topology
    kvmesh envoy render --all [--check]            every envoy/*.yaml -> envoy/rendered/
                                                   (+ deploy/base/envoy/, deploy/overlays/tracing/
                                                   for Kubernetes)

What the rendered Envoy does, and why:
- One public listener, codec AUTO: HTTP/1.1 and h2c (gRPC without TLS) on one port.
- gRPC to the public services only (kvmesh.v1.Inference, grpc.health.v1,
  reflection) goes to the gateways' gRPC ports over HTTP/2; every other gRPC
  path (the internal kvmesh.v1.Scheduler / kvmesh.v1.Engine, anything else
  with a gRPC content-type) is answered by Envoy: 404 / UNIMPLEMENTED. The
  OpenAI HTTP API (/v1/...) and everything else go to their HTTP ports over
  HTTP/1.1 (aiohttp cannot be an HTTP/2 upstream).
- Streams are never cut: route `timeout: 0s` (Envoy's default 15 s kills
  streams) and idle timeouts far above the gateway's 15 s heartbeat.
- A request body over `max_request_bytes` gets 413, counted as it streams
  (body_size_limit filter), not by buffering (the buffer filter would hold a
  gRPC stream until its end).
- Gateways are health-checked actively (gRPC health / GET /health) and
  passively (outlier detection on connection-level failures only: a gateway
  that answers 503 "no engine" is working correctly and must not be ejected).
  Retries only when the request never reached a gateway.
- Envoy's own error answers (413, 429, 503 no healthy upstream) carry an
  OpenAI-style JSON error body; gRPC callers get a gRPC status instead.
- x-request-id: kept when the client sends one, generated otherwise,
  forwarded to the gateway and echoed in the response; JSON access log on stdout.
- CORS: allowed origins' preflights are answered by Envoy; any other
  preflight gets 403 from Envoy (never reaches a gateway).
- Local rate limit: a global bucket and/or one bucket per Authorization
  header value (per API key); 429 + Retry-After.
- Optional TLS with ALPN h2/http1.1; the browser chat page (web/) is served
  by Envoy from files read at start-up.
- Admin (and /stats/prometheus) on loopback only (checked by the topology);
  optionally a stats-only listener forwarding GET /stats/prometheus alone to
  it (stats.py), for a Prometheus in another pod.

Structure: this module assembles the bootstrap and runs the command;
listener.py (connection manager, TLS, local replies) with routes.py and
http_filters.py, and clusters.py (the gateway clusters) build its parts, from
the pieces in fragments.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from services.edge.clusters import batch_cluster, cluster
from services.edge.fragments import GRPC_CLUSTER, HTTP_CLUSTER, TYPE, socket_address
from services.edge.listener import listener
from services.edge.routes import PUBLIC_GRPC_PREFIXES, WEB_FILES
from services.edge.stats import admin_cluster, stats_listener
from services.edge.topology import Topology, TopologyError, load_topology
from services.edge.tracing import collector_cluster

__all__ = [
    "DEPLOY_ENVOY_DIR",
    "DEPLOY_TRACING_ENVOY",
    "ENVOY_DIR",
    "GRPC_CLUSTER",
    "HTTP_CLUSTER",
    "PUBLIC_GRPC_PREFIXES",
    "RENDERED_DIR",
    "main",
    "render",
    "render_yaml",
    "rendered_path_for",
]


ROOT = Path(__file__).resolve().parents[2]
ENVOY_DIR = ROOT / "envoy"
RENDERED_DIR = ENVOY_DIR / "rendered"
DEFAULT_TOPOLOGY = ENVOY_DIR / "topology.yaml"
# Kustomize reads files only below its kustomization's folder: the
# Kubernetes rendering and the files it names (descriptor set, web page) are
# copied there by `--all` (and compared by `--all --check`).
KUBERNETES_TOPOLOGY = ENVOY_DIR / "topology-kubernetes.yaml"
DEPLOY_ENVOY_DIR = ROOT / "deploy" / "base" / "envoy"
# The same with tracing on: deploy/overlays/tracing's Envoy bootstrap.
KUBERNETES_TRACING_TOPOLOGY = ENVOY_DIR / "topology-kubernetes-tracing.yaml"
DEPLOY_TRACING_ENVOY = ROOT / "deploy" / "overlays" / "tracing" / "envoy.yaml"


def render(topology: Topology) -> dict[str, Any]:
    """The Envoy bootstrap for `topology`, as plain data."""
    topology.validate()
    return {
        "node": {"id": "kvmesh-edge", "cluster": "kvmesh"},
        "admin": {"address": socket_address(topology.admin.host, topology.admin.port)},
        "static_resources": {
            "listeners": [
                listener(topology),
                *([stats_listener(topology.stats)] if topology.stats.enabled else []),
            ],
            "clusters": [
                cluster(topology, GRPC_CLUSTER, grpc=True),
                cluster(topology, HTTP_CLUSTER, grpc=False),
                *([batch_cluster(topology)] if topology.batch.enabled else []),
                *([collector_cluster(topology.tracing)] if topology.tracing.enabled else []),
                *([admin_cluster(topology.admin.host, topology.admin.port)] if topology.stats.enabled else []),
            ],
        },
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        TYPE: "type.googleapis.com/envoy.extensions.resource_monitors."
                        "downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": topology.max_connections,
                    },
                }
            ]
        },
    }


def render_yaml(topology: Topology, source: str = "") -> str:
    """The bootstrap as YAML text, with a header naming its source."""
    header = (
        f"# Generated by `kvmesh envoy render` from {source or 'a topology'}; do not edit.\n"
        "# Re-render with `make render`.\n"
    )
    return header + yaml.safe_dump(render(topology), sort_keys=False, default_flow_style=False)


def rendered_path_for(topology_path: Path) -> Path:
    """envoy/topology.yaml -> envoy/rendered/envoy.yaml;
    envoy/topology-NAME.yaml -> envoy/rendered/envoy-NAME.yaml."""
    stem = topology_path.stem
    suffix = stem[len("topology"):] if stem.startswith("topology") else f"-{stem}"
    return RENDERED_DIR / f"envoy{suffix}.yaml"


def _topologies() -> list[Path]:
    return sorted(p for p in ENVOY_DIR.glob("*.yaml") if p.is_file())


def _deploy_copies() -> list[tuple[Path, Path]]:
    """(source, copy) pairs of deploy/base/envoy/ and deploy/overlays/tracing/."""
    pairs = [
        (rendered_path_for(KUBERNETES_TOPOLOGY), DEPLOY_ENVOY_DIR / "envoy.yaml"),
        (ENVOY_DIR / "kvmesh.pb", DEPLOY_ENVOY_DIR / "kvmesh.pb"),
        (rendered_path_for(KUBERNETES_TRACING_TOPOLOGY), DEPLOY_TRACING_ENVOY),
    ]
    pairs += [(ROOT / "web" / name, DEPLOY_ENVOY_DIR / "web" / name) for name, _ in WEB_FILES.values()]
    return pairs


def _sync_copies(rendered: dict[Path, bytes], check: bool) -> list[str]:
    """Write (or with `check`, compare) the deploy copies; `rendered` holds
    this run's renderings by output path. Returns the stale copies."""
    stale: list[str] = []
    for source, copy in _deploy_copies():
        data = rendered.get(source.resolve())
        if data is None:
            data = source.read_bytes()
        if check:
            if not copy.exists() or copy.read_bytes() != data:
                stale.append(f"{_relative(copy)} (copy of {_relative(source)})")
        elif not copy.exists() or copy.read_bytes() != data:
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(data)
            print(f"copied {_relative(source)} -> {_relative(copy)}")
    return stale


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh envoy render", description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY,
                        help=f"topology YAML (default {_relative(DEFAULT_TOPOLOGY)})")
    parser.add_argument("--out", type=Path, help="output file (default: envoy/rendered/...; '-' = stdout)")
    parser.add_argument("--all", action="store_true", help="render every envoy/*.yaml")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail if a rendered file is missing or out of date")
    args = list(sys.argv[1:] if argv is None else argv)
    # `kvmesh envoy render ...` hands us ["render", ...]; render is the only verb.
    if not args or args[0] != "render":
        parser.error("usage: kvmesh envoy render [--topology F] [--out F] [--all] [--check]")
    ns = parser.parse_args(args[1:])
    if ns.all and ns.out:
        parser.error("--out cannot be used with --all")
    jobs = [(p, rendered_path_for(p)) for p in _topologies()] if ns.all else [
        (ns.topology, ns.out or rendered_path_for(ns.topology))
    ]
    stale: list[str] = []
    rendered: dict[Path, bytes] = {}
    for source, out in jobs:
        try:
            text = render_yaml(load_topology(source), _relative(source))
        except TopologyError as exc:
            print(f"kvmesh envoy render: {exc}", file=sys.stderr)
            return 2
        rendered[Path(out).resolve()] = text.encode()
        if str(out) == "-":
            sys.stdout.write(text)
        elif ns.check:
            if not out.exists() or out.read_text() != text:
                stale.append(f"{_relative(out)} (from {_relative(source)})")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"rendered {_relative(source)} -> {_relative(out)}")
    if ns.all:
        stale += _sync_copies(rendered, ns.check)
    if stale:
        print("kvmesh envoy render: out of date, run `make render`: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
