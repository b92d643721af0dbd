"""The edge topology: what Envoy fronts and how, as typed dataclasses.

A topology YAML (envoy/*.yaml) says where the public listener and the admin
interface live, which gateway replicas sit behind Envoy, and the edge's
limits and timeouts. `services.edge.render` turns it into a full Envoy v3
bootstrap. Unknown keys are errors and every error names the setting path,
exactly like the mesh config (the same strict loader is used).

The types live here and not in services/common/config/: only the edge and
the launcher read them. The launcher builds a run-time topology from the
mesh config (actual ports) with `Topology.with_ports`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.common.config import ConfigError, config_from_dict
from services.edge.stats import StatsSpec
from services.edge.tracing import TracingSpec

__all__ = [
    "AdminSpec",
    "BatchEndpoint",
    "CorsSpec",
    "DnsSpec",
    "GatewayEndpoint",
    "HealthCheckSpec",
    "ListenerSpec",
    "RateLimitSpec",
    "StatsSpec",
    "TimeoutSpec",
    "TlsSpec",
    "UpstreamTlsSpec",
    "Topology",
    "TopologyError",
    "TranscoderSpec",
    "WebSpec",
    "load_topology",
]


class TopologyError(ConfigError):
    """A topology setting is missing, unknown, of the wrong type or out of bounds."""


@dataclass
class ListenerSpec:
    """The public listener: HTTP/1.1 and h2c on one port (codec AUTO)."""

    # Loopback by default: exposing the mesh is an explicit decision.
    host: str = "127.0.0.1"
    # 8080: the port README's examples use. Bounds: 1-65535.
    port: int = 8080


@dataclass
class AdminSpec:
    """Envoy's admin interface (/ready, /stats, /clusters). Never public."""

    host: str = "127.0.0.1"
    port: int = 9901


@dataclass
class GatewayEndpoint:
    """One gateway replica: its HTTP (OpenAI/SSE, aiohttp) and gRPC ports."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50061


@dataclass
class BatchEndpoint:
    """The batch service (`kvmesh batch`, services/batch/): Envoy routes
    /v1/files and /v1/batches to it, plain HTTP/1.1. On Kubernetes its
    Service's DNS name. Off: those paths go to the gateways (404)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    # The mesh config's batch.port.
    port: int = 8090


@dataclass
class DnsSpec:
    """How Envoy resolves gateway hosts given by DNS name (STRICT_DNS), e.g.
    a Kubernetes headless Service: every address a name resolves to is a
    gateway, health-checked on its own. Unused when every host is an IP."""

    # Re-resolve this often, so a new gateway pod gets traffic (and a gone
    # one's address is dropped) within seconds. Bounds: >= 0.1.
    refresh_seconds: float = 5.0
    # Re-resolve when a record's TTL ends, if sooner (CoreDNS: 5 s for
    # headless Services).
    respect_ttl: bool = True
    # After a failed lookup, retry this soon (the old addresses are kept
    # meanwhile). Bounds: >= 0.1.
    failure_refresh_seconds: float = 1.0
    # AUTO (IPv6 first), V4_ONLY, V6_ONLY, V4_PREFERRED or ALL.
    lookup_family: str = "V4_PREFERRED"


@dataclass
class TimeoutSpec:
    """Timeouts, all in seconds. Streams must never be cut by a timeout that
    a heartbeat does not beat: the gateway sends an SSE comment / gRPC
    heartbeat every 15 s, so every idle timeout here is far above that."""

    # TCP connect to a gateway; short, so a dead replica is retried elsewhere
    # quickly. Bounds: > 0.
    connect_seconds: float = 2.0
    # No bytes on a stream for this long -> reset. 300 s = 20 heartbeats.
    stream_idle_seconds: float = 300.0
    # Downstream connection with no streams for this long is closed. An hour
    # keeps browser and SDK keep-alive connections warm.
    connection_idle_seconds: float = 3600.0
    # Upstream (Envoy -> aiohttp) keep-alive connection idle timeout; below
    # aiohttp's 75 s keepalive so Envoy, not the server, closes first (no
    # request racing a server-side close).
    upstream_idle_seconds: float = 60.0
    # Whole request headers must arrive within this (slowloris guard).
    request_headers_seconds: float = 10.0
    # A gateway host that vanished without a reset (silent partition) is
    # noticed on an upstream connection within the sum of these two: HTTP/2
    # PING after upstream_keepalive_seconds of silence on the gRPC cluster,
    # and the ack awaited upstream_keepalive_timeout_seconds; TCP keepalive
    # on the HTTP/1.1 cluster (first probe after upstream_keepalive_seconds,
    # 3 probes spread over the timeout). Envoy then ends the client's stream,
    # which can resume on another gateway (Last-Event-ID). `kvmesh up` sets
    # both from the mesh's `network` block; defaults are the same. Bounds:
    # >= 1 (whole seconds for TCP keepalive; fractions are rounded up).
    upstream_keepalive_seconds: float = 5.0
    upstream_keepalive_timeout_seconds: float = 5.0


@dataclass
class HealthCheckSpec:
    """Active health checks of every gateway replica (gRPC health for the
    gRPC cluster, GET /health for the HTTP cluster)."""

    # Every second: a draining gateway (SIGTERM) leaves the rotation within
    # `removal_seconds` = 1 x 2 + 1 = 3 s, its gateway.drain_unready_seconds;
    # two cheap checks a second per replica cost nothing.
    interval_seconds: float = 1.0
    timeout_seconds: float = 1.0
    # Failed checks before a replica leaves the rotation (2: one lost check
    # on a busy host does not flap it).
    unhealthy_threshold: int = 2
    # Passed checks before it comes back; 1 = at once.
    healthy_threshold: int = 1
    # gRPC health service name the gateway reports on.
    grpc_service: str = "kvmesh.v1.Inference"
    # HTTP path answering 200 while the gateway can serve.
    http_path: str = "/health"

    @property
    def removal_seconds(self) -> float:
        """Longest time from a replica failing its checks (a draining
        gateway) to Envoy taking it out of the rotation: `unhealthy_threshold`
        checks, one per interval, the last one waiting up to its timeout."""
        return self.interval_seconds * self.unhealthy_threshold + self.timeout_seconds


@dataclass
class RateLimitSpec:
    """Envoy's local rate limit: the coarse outer guard per Envoy instance,
    in front of the gateway's own per-key request/token buckets. Answers 429
    (gRPC RESOURCE_EXHAUSTED) with Retry-After. Each rate 0 = off."""

    # One bucket for every request through this Envoy.
    requests_per_second: float = 0.0
    # Requests allowed in a burst above the rate; 0 = one second's worth.
    burst: int = 0
    # One bucket per distinct Authorization header value (per API key), so
    # one flooding key cannot starve the others at the edge. Requests
    # without the header only meet the global bucket above.
    per_key_requests_per_second: float = 0.0
    # 0 = one second's worth.
    per_key_burst: int = 0
    # Most per-key buckets Envoy keeps (LRU); a key evicted and seen again
    # starts with a full bucket. 10k keys cost well under a megabyte.
    max_keys: int = 10_000


@dataclass
class CorsSpec:
    """CORS for browsers on other origins; empty = no CORS filter."""

    # Exact origins, e.g. "http://localhost:3000".
    allow_origins: list[str] = field(default_factory=list)
    max_age_seconds: int = 600


@dataclass
class TranscoderSpec:
    """gRPC-JSON transcoding of kvmesh.v1.Inference (POST /v1/chat,
    /v1/generate as SSE via stream_sse_style_delimited) for browsers."""

    enabled: bool = True
    # Descriptor set from `python -m services.tools.protogen`. Relative to
    # Envoy's working directory (the repository root); the launcher renders
    # an absolute path.
    descriptor: str = "envoy/kvmesh.pb"


@dataclass
class TlsSpec:
    """TLS on the public listener, ALPN h2 + http/1.1 (gRPC and browsers get
    HTTP/2, curl without --http2 gets HTTP/1.1); off = plaintext h2c/HTTP/1.1."""

    enabled: bool = False
    # PEM files, relative to the repository root. Both empty = development
    # certificates `kvmesh up` generates in <run_dir>/tls (a local CA,
    # ca.pem, that clients trust explicitly; server cert for localhost and
    # 127.0.0.1). Never use the dev CA outside one machine.
    cert_chain: str = ""
    private_key: str = ""


@dataclass
class UpstreamTlsSpec:
    """Mutual TLS from Envoy to the gateways, when the mesh runs `mesh_tls`:
    Envoy's mesh certificate and key, the mesh CA, and the name every
    gateway's certificate must carry (SNI and SAN check). The launcher fills
    it in from the mesh's config; empty = plaintext to the gateways."""

    cert_chain: str = ""
    private_key: str = ""
    ca: str = ""
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_chain)


@dataclass
class WebSpec:
    """The browser chat page, served by Envoy itself (direct responses read
    from these files when Envoy starts), so no web server is needed."""

    enabled: bool = True
    # Folder with index.html, chat.js and chat.css; relative to the repo root.
    root: str = "web"


@dataclass
class Topology:
    listener: ListenerSpec = field(default_factory=ListenerSpec)
    admin: AdminSpec = field(default_factory=AdminSpec)
    # Gateway replicas behind Envoy. At least one.
    gateways: list[GatewayEndpoint] = field(default_factory=lambda: [GatewayEndpoint()])
    batch: BatchEndpoint = field(default_factory=BatchEndpoint)
    timeouts: TimeoutSpec = field(default_factory=TimeoutSpec)
    dns: DnsSpec = field(default_factory=DnsSpec)
    health_check: HealthCheckSpec = field(default_factory=HealthCheckSpec)
    # Largest request body (JSON or gRPC message) Envoy lets through; larger
    # -> 413 with an OpenAI error body. 1 MiB matches gateway.max_body_bytes.
    # Counted while streaming, never buffered.
    max_request_bytes: int = 1_048_576
    # Retries when a gateway cannot be reached or resets before the request
    # was sent (never after: a generation is not idempotent).
    connect_retries: int = 2
    rate_limit: RateLimitSpec = field(default_factory=RateLimitSpec)
    cors: CorsSpec = field(default_factory=CorsSpec)
    transcoder: TranscoderSpec = field(default_factory=TranscoderSpec)
    tls: TlsSpec = field(default_factory=TlsSpec)
    upstream_tls: UpstreamTlsSpec = field(default_factory=UpstreamTlsSpec)
    web: WebSpec = field(default_factory=WebSpec)
    # Cap on concurrent downstream connections (Envoy's overload manager).
    max_connections: int = 50_000
    # Envoy's OpenTelemetry spans (services/edge/tracing.py); off by default.
    tracing: TracingSpec = field(default_factory=TracingSpec)
    # A listener serving only GET /stats/prometheus (services/edge/stats.py); off by default.
    stats: StatsSpec = field(default_factory=StatsSpec)

    def validate(self, heartbeat_seconds: float | None = None) -> None:
        """Raise TopologyError for values out of bounds. With the gateway's
        heartbeat, also check that no idle timeout can cut a live stream.
        Checks run in declaration order; the first failure is raised."""
        self._validate_addresses()
        self._validate_timeouts()
        self._validate_limits()
        self._validate_tls()
        if (problem := self.tracing.validate()) is not None:
            raise TopologyError(problem)
        taken = {"listener.port": self.listener.port, "admin.port": self.admin.port}
        if (problem := self.stats.validate(taken)) is not None:
            raise TopologyError(problem)
        if self.max_connections < 1:
            raise TopologyError("max_connections: must be >= 1")
        if heartbeat_seconds is not None and heartbeat_seconds > 0:
            self._validate_idle_timeout(heartbeat_seconds)

    def _validate_idle_timeout(self, heartbeat_seconds: float) -> None:
        """A stream is idle at most one heartbeat apart; twice that leaves room for a late one."""
        if self.timeouts.stream_idle_seconds <= 2 * heartbeat_seconds:
            raise TopologyError(
                f"timeouts.stream_idle_seconds: {self.timeouts.stream_idle_seconds} s would "
                f"cut idle streams; make it more than twice gateway.heartbeat_seconds "
                f"({heartbeat_seconds} s)"
            )

    def _validate_addresses(self) -> None:
        _port(self.listener.port, "listener.port")
        _port(self.admin.port, "admin.port")
        if not _is_loopback(self.admin.host):
            raise TopologyError(
                f"admin.host: {self.admin.host} is not a loopback address; Envoy's admin "
                "interface (and /stats/prometheus) can reconfigure Envoy, keep it on 127.0.0.1"
            )
        if not self.gateways:
            raise TopologyError("gateways: at least one gateway replica is required")
        for i, gw in enumerate(self.gateways):
            _port(gw.http_port, f"gateways[{i}].http_port")
            _port(gw.grpc_port, f"gateways[{i}].grpc_port")
        _port(self.batch.port, "batch.port")

    def _validate_timeouts(self) -> None:
        for name in ("connect_seconds", "stream_idle_seconds", "connection_idle_seconds",
                     "upstream_idle_seconds", "request_headers_seconds"):
            if getattr(self.timeouts, name) <= 0:
                raise TopologyError(f"timeouts.{name}: must be > 0")
        for name in ("upstream_keepalive_seconds", "upstream_keepalive_timeout_seconds"):
            if getattr(self.timeouts, name) < 1:
                raise TopologyError(f"timeouts.{name}: must be >= 1")
        if min(self.dns.refresh_seconds, self.dns.failure_refresh_seconds) < 0.1:
            raise TopologyError("dns: refresh_seconds and failure_refresh_seconds must be >= 0.1")
        if self.dns.lookup_family not in _LOOKUP_FAMILIES:
            raise TopologyError(f"dns.lookup_family: one of {', '.join(_LOOKUP_FAMILIES)}")
        hc = self.health_check
        if hc.interval_seconds <= 0 or hc.timeout_seconds <= 0:
            raise TopologyError("health_check: interval_seconds and timeout_seconds must be > 0")
        if hc.unhealthy_threshold < 1 or hc.healthy_threshold < 1:
            raise TopologyError("health_check: thresholds must be >= 1")

    def _validate_limits(self) -> None:
        if not 1024 <= self.max_request_bytes <= 64 * 1024 * 1024:
            raise TopologyError("max_request_bytes: must be within 1 KiB .. 64 MiB")
        if not 0 <= self.connect_retries <= 10:
            raise TopologyError("connect_retries: must be within 0 .. 10")
        rate = self.rate_limit
        if min(rate.requests_per_second, rate.burst, rate.per_key_requests_per_second, rate.per_key_burst) < 0:
            raise TopologyError("rate_limit: rates and bursts must be >= 0")
        if not 1 <= rate.max_keys <= 1_000_000:
            raise TopologyError("rate_limit.max_keys: must be within 1 .. 1000000")

    def _validate_tls(self) -> None:
        if bool(self.tls.cert_chain) != bool(self.tls.private_key):
            raise TopologyError("tls: give both cert_chain and private_key, or neither (dev certificates)")
        up = self.upstream_tls
        if up.enabled and not (up.private_key and up.ca and up.server_name):
            raise TopologyError("upstream_tls: cert_chain needs private_key, ca and server_name")

    def with_ports(
        self,
        listener: ListenerSpec,
        admin: AdminSpec,
        gateways: list[GatewayEndpoint],
        descriptor: str | None = None,
        batch: BatchEndpoint | None = None,
    ) -> Topology:
        """A copy with run-time addresses (what the launcher actually started)."""
        transcoder = dataclasses.replace(self.transcoder)
        if descriptor is not None:
            transcoder.descriptor = descriptor
        return dataclasses.replace(
            self, listener=listener, admin=admin, gateways=list(gateways), transcoder=transcoder,
            batch=batch or self.batch,
        )

    def with_files(self, root: Path, cert_chain: str = "", private_key: str = "") -> Topology:
        """A copy whose file settings (descriptor, web root, TLS files) are
        absolute, resolved against `root`, so Envoy may run from any folder;
        `cert_chain`/`private_key` fill in TLS files left empty (dev certs)."""
        def resolve(path: str) -> str:
            return path if not path or Path(path).is_absolute() else str(root / path)

        tls = dataclasses.replace(self.tls)
        if tls.enabled and not tls.cert_chain:
            tls.cert_chain, tls.private_key = cert_chain, private_key
        tls.cert_chain, tls.private_key = resolve(tls.cert_chain), resolve(tls.private_key)
        return dataclasses.replace(
            self,
            transcoder=dataclasses.replace(self.transcoder, descriptor=resolve(self.transcoder.descriptor)),
            web=dataclasses.replace(self.web, root=resolve(self.web.root)),
            tls=tls,
        )


_LOOKUP_FAMILIES = ("AUTO", "V4_ONLY", "V6_ONLY", "V4_PREFERRED", "ALL")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _port(value: int, where: str) -> None:
    if not 1 <= value <= 65535:
        raise TopologyError(f"{where}: {value} is not a TCP port (1-65535)")


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML; errors name the file and setting."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise TopologyError(f"{path}: cannot read topology: {exc}") from exc
    try:
        topology = config_from_dict(Topology, data, str(path))
    except TopologyError:
        raise
    except ConfigError as exc:
        raise TopologyError(str(exc)) from exc
    try:
        topology.validate()
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}") from exc
    return topology
