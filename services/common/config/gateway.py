"""Gateway settings and its API keys, under `gateway` in the YAML. Bounds
(and the keys' hashes, tenants and ceilings) are checked at load by
`validation.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .addresses import scheduler_addresses
from .response_cache import ResponseCacheConfig

__all__ = ["ApiKeyConfig", "ApiKeysFile", "GatewayConfig"]


@dataclass
class ApiKeyConfig:
    """An API key. Only its SHA-256 is stored (`kvmesh key hash KEY`)."""

    # 64 hex digits (case and surrounding blanks ignored); unique per key.
    sha256: str = ""
    # Required: whose quota and fair share the key's requests count against.
    tenant: str = ""
    # Best class the key may ask for: 0 allows P0. One of 0, 1, 2.
    priority_ceiling: int = 0
    # Models the key may use; empty = all.
    models: list[str] = field(default_factory=list)
    # Token buckets; 0 = unlimited. Bounds: >= 0 (as for the next one).
    requests_per_second: float = 0.0
    tokens_per_minute: float = 0.0
    # Longest generation in seconds for this key; 0 = the gateway default.
    max_generation_seconds: float = 0.0
    # The response cache (gateway.response_cache; README "Response cache"):
    # "off" (default: every request reaches an engine), "on" (every
    # deterministic request -- temperature 0 or a seed -- may be answered
    # from it), "request" (only requests sending `X-Kvmesh-Cache: on`).
    response_cache: str = "off"
    # true: this key's entries are shared with every other key that shares
    # (a fleet of identical clients); false: only this key's tenant sees them.
    share_response_cache: bool = False


@dataclass
class ApiKeysFile:
    """The document `gateway.api_keys_file` names."""

    api_keys: list[ApiKeyConfig] = field(default_factory=list)


@dataclass
class GatewayConfig:
    """One gateway replica: its listeners, API keys and per-request limits."""

    host: str = "127.0.0.1"
    # Ports 0 .. 65535: 0 binds any free port (metrics: 0 = off).
    http_port: int = 8000
    grpc_port: int = 50061
    metrics_port: int = 9102
    # Where the scheduler's gRPC service is.
    scheduler_address: str = "127.0.0.1:50051"
    # Several active scheduler replicas: each request is admitted on one of
    # them (rendezvous hash of its id over the replicas reachable now) and
    # moves to another when that one goes away (services/gateway/
    # scheduler_replicas.py). Non-empty overrides `scheduler_address` (the
    # one-element case); each `host:port`, no duplicates. Read both through
    # `GatewayConfig.schedulers()`.
    scheduler_addresses: list[str] = field(default_factory=list)
    # Off only for local experiments: then every request is tenant "anonymous".
    auth_enabled: bool = True
    api_keys: list[ApiKeyConfig] = field(default_factory=list)
    # More API keys in a file of their own, read by the gateway when it
    # starts (services/gateway/keys.py): on Kubernetes the Secret
    # `kvmesh-api-keys` mounted as a file, so the hashes stay out of the
    # ConfigMap. A YAML mapping with one key, `api_keys:`, a list of entries
    # exactly like `api_keys` here (sha256, tenant, ...); the gateway accepts
    # the keys of both, and a hash listed twice is an error. Relative paths
    # are relative to the repository root. Empty = no file.
    api_keys_file: str = ""
    # SSE comment every 15 s: below common 30-60 s proxy idle timeouts, and
    # the figure from the source articles (45 s without one = zombie). > 0
    # (the edge's stream idle timeout must exceed twice this).
    heartbeat_seconds: float = 15.0
    # Longest generation before a timeout event (source articles: 120 s). > 0.
    max_generation_seconds: float = 120.0
    # Bodies larger than this get 413. > 0.
    max_body_bytes: int = 1_048_576
    # max_tokens when the client gives none. > 0.
    default_max_tokens: int = 256
    # Prompts appear in logs only when true.
    log_prompts: bool = False
    # Engine failures before the first token are retried elsewhere this often;
    # mid-stream failures migrate the stream at most this often. >= 0
    # (0 = the first engine failure ends the request).
    max_migrations: int = 3
    # Drain on SIGTERM (services/gateway/drain.py): the gateway turns not
    # ready at once (gRPC health NOT_SERVING, GET /health 503) and keeps
    # serving -- also requests that still arrive -- for
    # `drain_unready_seconds`, the time its load balancer needs to take it
    # out of rotation (Envoy: health-check interval x unhealthy_threshold +
    # timeout = 1 x 2 + 1 s with the shipped edge; `kvmesh up` refuses an
    # edge whose bound is longer). Then it waits for in-flight streams to
    # finish; `drain_seconds` after SIGTERM it closes the streams still open
    # WITHOUT cancelling their generations (they detach on their engines and
    # a client resuming with Last-Event-ID continues them through another
    # gateway), and stops.
    # Unset (the default) = `drain_bound_seconds`: the mesh's generation
    # bound (`max_generation_seconds`) after the last moment the load
    # balancer may still send a request (`drain_unready_seconds`), so no
    # generation this gateway may start is cut -- a rolling update is
    # invisible to every client, resuming or not (issue 29: a fixed 30 s
    # broke 6 of 12 long streams of plain clients). Set it lower only where
    # every client resumes. Every supervisor derives its wait from the same
    # number: `kvmesh up` waits drain_bound_seconds + 10 s before SIGKILL;
    # Kubernetes' terminationGracePeriodSeconds and Envoy's drain are
    # checked against it (tests/deploy/wiring.py).
    # Bounds: 0 <= drain_unready_seconds <= drain_seconds (when set).
    drain_seconds: float | None = None
    drain_unready_seconds: float = 3.0
    # Completed deterministic answers replayed without an engine
    # (services/common/config/response_cache.py).
    response_cache: ResponseCacheConfig = field(default_factory=ResponseCacheConfig)

    @property
    def drain_bound_seconds(self) -> float:
        """Seconds from SIGTERM to the drain's cut: `drain_seconds`, or when
        unset the generation bound after the load balancer's (see above).
        The one place the default is resolved."""
        if self.drain_seconds is not None:
            return self.drain_seconds
        return self.drain_unready_seconds + self.max_generation_seconds

    def schedulers(self) -> list[str]:
        """The scheduler replicas to dial (`scheduler_addresses`, else the one
        `scheduler_address`)."""
        return scheduler_addresses(self.scheduler_address, self.scheduler_addresses)
