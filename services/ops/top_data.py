"""What `kvmesh top` shows, gathered once per refresh: the scheduler's
GetState (engines, queues by class, paused classes, drained engines, the
policy) and the Prometheus text of every metrics port it knows (engines:
tokens/s and health; gateways: open streams, requests/s, rejections; the
scheduler: rejections by reason).

Where the metrics ports are: from the mesh config (`--config`; the file
`kvmesh up` writes, RUN_DIR/kvmesh.resolved.yaml, has every port of the
run): engine i = `engine-<i>` on engines.metrics_base_port + i, gateway
replica r on gateway.metrics_port + r for the `--gateways` replicas, the
scheduler on scheduler.metrics_port. An engine the config does not name
shows the scheduler's figures only. Rates (tokens/s, requests/s) are
counter differences between two refreshes, so the first frame has none.

`Gatherer.frame()` never raises for an unreachable peer: the frame says
which one and why, and the rest is shown.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["DeadlineRow", "EngineRow", "Frame", "Gatherer", "GatewayRow", "QueueRow", "Samples", "ScalingRow",
           "parse_samples", "targets"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_HTTP_TIMEOUT_SECONDS = 0.8
_CLASSES = (0, 1, 2)
# kvmesh_gateway_requests_total's `status` of a served request (HTTP, gRPC).
_OK = frozenset({"200", "OK"})


@dataclass(frozen=True)
class EngineRow:
    engine_id: str
    status: str                    # serving | drained | draining | not serving | stale
    kv_used: float                 # 0..1 of its KV blocks
    running: int
    waiting: int
    tokens_per_second: float | None   # generated, between two refreshes
    health: str                    # its ready probe: "ok", "draining"... or "?"


@dataclass(frozen=True)
class QueueRow:
    priority: int
    queued: int
    oldest_wait_seconds: float
    paused: bool
    batch: bool = False        # Batch API lines (GetState's batch rows): shown apart from P2


@dataclass(frozen=True)
class DeadlineRow:
    """One learned deadline (GetState's DeadlineState)."""

    model: str
    priority: int
    kind: str                      # queue_wait | first_token | token_stall | generation
    p95_seconds: float
    samples: int
    deadline_seconds: float
    source: str                    # derived | floor | ceiling | default


@dataclass(frozen=True)
class ScalingRow:
    """The scaling policy's figure for one model (GetState's ModelScaling)."""

    model: str
    desired: int                   # serving + warm spares
    current: int                   # registered, not draining
    spares: int
    reason: str
    autoscaled: bool


@dataclass(frozen=True)
class GatewayRow:
    name: str
    open_streams: int | None
    requests_per_second: float | None
    rejections: int | None         # requests answered with an error since it started


@dataclass
class Frame:
    taken_at: float                # wall clock
    scheduler: str
    policy: str = "?"
    replica: str = ""              # SchedulerState.replica: which of several schedulers (--scheduler picks)
    peers: int = 0                 # SchedulerState.peers: the other replicas it hears the queue heads of
    engines: list[EngineRow] = field(default_factory=list)
    queues: list[QueueRow] = field(default_factory=list)
    gateways: list[GatewayRow] = field(default_factory=list)
    rejections: dict[str, int] = field(default_factory=dict)   # "scheduler queue_full" -> count
    deadlines: list[DeadlineRow] = field(default_factory=list)
    scaling: list[ScalingRow] = field(default_factory=list)
    leases: int = 0
    problems: list[str] = field(default_factory=list)


def parse_samples(text: str) -> Samples:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _total(samples: Samples, name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float | None:
    found = [v for (n, labels), v in samples.items() if n == name and where(dict(labels))]
    return sum(found) if found else None


def targets(config: MeshConfig, gateways: int) -> tuple[dict[str, str], list[str], str]:
    """(engine id -> metrics host:port, gateway metrics host:ports, the
    scheduler's metrics host:port or "") from the config's port plan."""
    engines = {}
    for i in range(config.engines.count):
        e = config.engine_config(i)
        if e.metrics_port:
            engines[e.engine_id] = join_host_port(_reachable(e.host), e.metrics_port)
    g = config.gateway
    gws = [join_host_port(_reachable(g.host), g.metrics_port + r) for r in range(gateways)] if g.metrics_port else []
    s = config.scheduler
    return engines, gws, join_host_port(_reachable(s.host), s.metrics_port) if s.metrics_port else ""


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_SECONDS) as answer:
        return str(answer.read().decode())


def _ready(address: str) -> str:
    try:
        body = _get(f"http://{address}/health/ready")
    except urllib.error.HTTPError as err:   # 503: not ready, with its reason
        body = err.read().decode()
    except OSError:
        return "unreachable"
    try:
        return str(json.loads(body).get("status", "?"))
    except ValueError:
        return "?"


class Gatherer:
    """One per `kvmesh top` run: keeps the previous counters for rates."""

    def __init__(self, channel: grpc.Channel, scheduler: str, engine_metrics: dict[str, str],
                 gateway_metrics: list[str], scheduler_metrics: str) -> None:
        self._stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self._scheduler = scheduler
        self._engine_metrics = engine_metrics
        self._gateway_metrics = gateway_metrics
        self._scheduler_metrics = scheduler_metrics
        self._previous: dict[str, tuple[float, float]] = {}   # key -> (monotonic, counter)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvmesh-top")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _rate(self, key: str, value: float | None, now: float) -> float | None:
        if value is None:
            self._previous.pop(key, None)
            return None
        before = self._previous.get(key)
        self._previous[key] = (now, value)
        if before is None or now <= before[0] or value < before[1]:   # first look, or a restart
            return None
        return (value - before[1]) / (now - before[0])

    def frame(self) -> Frame:
        frame = Frame(time.time(), self._scheduler)
        urls = {f"m {a}": f"http://{a}/metrics"
                for a in [*self._engine_metrics.values(), *self._gateway_metrics, self._scheduler_metrics] if a}
        state_f = self._pool.submit(self._stub.GetState, scheduler_pb2.GetStateRequest(), timeout=2.0)
        text_fs = {key: self._pool.submit(_get, url) for key, url in urls.items()}
        ready_fs = {eid: self._pool.submit(_ready, a) for eid, a in self._engine_metrics.items()}
        scraped: dict[str, Samples] = {}
        for key, future in text_fs.items():
            try:
                scraped[key[2:]] = parse_samples(future.result())
            except (OSError, ValueError) as exc:
                frame.problems.append(f"{key[2:]}: {getattr(exc, 'reason', exc)}")
        now = time.monotonic()
        try:
            state = state_f.result()
        except grpc.RpcError as err:
            frame.problems.append(f"scheduler {self._scheduler}: {err.code().name}: {err.details()}")
            state = scheduler_pb2.SchedulerState(policy="?")
        ready = {eid: f.result() for eid, f in ready_fs.items()}
        self._fill_scheduler(frame, state, scraped, ready, now)
        self._fill_gateways(frame, scraped, now)
        return frame

    def _fill_scheduler(self, frame: Frame, state: scheduler_pb2.SchedulerState, scraped: dict[str, Samples],
                        ready: dict[str, str], now: float) -> None:
        frame.policy, frame.leases, frame.replica = state.policy, state.leases_total, state.replica
        frame.peers = len(state.peers)
        for e in state.engines:
            address = self._engine_metrics.get(e.engine_id, "")
            tokens = _total(scraped.get(address, {}), "vllm:generation_tokens_total")
            frame.engines.append(EngineRow(
                e.engine_id, _status(e), e.blocks_used / e.blocks_total if e.blocks_total else 0.0,
                e.running, e.waiting, self._rate(f"tokens {e.engine_id}", tokens, now),
                ready.get(e.engine_id, "?")))
        paused = set(state.paused_priorities)
        for cls, batch in [(c, False) for c in _CLASSES] + [(_CLASSES[-1], True)]:
            rows = [q for q in state.queues if q.priority == cls and q.batch == batch]
            if batch and not rows:
                continue
            frame.queues.append(QueueRow(cls, sum(q.queued for q in rows),
                                         max((q.oldest_wait_seconds for q in rows), default=0.0), cls in paused,
                                         batch))
        frame.deadlines = [DeadlineRow(d.model, d.priority, d.kind, d.p95_seconds, d.samples, d.deadline_seconds,
                                       d.source) for d in state.deadlines]
        frame.scaling = [ScalingRow(m.model, m.desired, m.current, m.spares, m.reason, m.autoscaled)
                         for m in state.scaling]
        for (name, labels), value in scraped.get(self._scheduler_metrics, {}).items():
            if name == "kvmesh_scheduler_rejections_total" and value:
                frame.rejections[f"scheduler {dict(labels).get('reason', '?')}"] = int(value)

    def _fill_gateways(self, frame: Frame, scraped: dict[str, Samples], now: float) -> None:
        for r, address in enumerate(self._gateway_metrics):
            samples = scraped.get(address)
            if samples is None:
                frame.gateways.append(GatewayRow(f"gateway-{r}", None, None, None))
                continue
            streams = _total(samples, "kvmesh_gateway_active_streams")
            requests = _total(samples, "kvmesh_gateway_requests_total", _is_request) or 0.0
            refused = _total(samples, "kvmesh_gateway_requests_total",
                             lambda lb: _is_request(lb) and lb.get("status") not in _OK) or 0.0
            frame.gateways.append(GatewayRow(
                f"gateway-{r}", None if streams is None else int(streams),
                self._rate(f"requests {address}", requests, now), int(refused)))
            for (name, labels), value in samples.items():
                if name == "kvmesh_gateway_rejections_total" and value:
                    key = f"gateway {dict(labels).get('reason', '?')}"
                    frame.rejections[key] = frame.rejections.get(key, 0) + int(value)


def _is_request(labels: dict[str, str]) -> bool:
    """A client's request, not a health check (Envoy's come every second)."""
    return not labels.get("route", "").startswith(("/health", "grpc.health"))


def _status(e: scheduler_pb2.EngineState) -> str:
    if e.drained_by_admin:
        return "drained"
    if not e.fresh:
        return "stale"
    if e.draining:
        return "draining"
    if e.spare:
        return "spare"      # warm, skipped by placement until promoted
    return "serving" if e.serving else "not serving"
