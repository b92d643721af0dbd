"""Scheduler settings: aging, admission limits, placement policies and the
queue policies, under `scheduler` in the YAML. Bounds are checked at load by
`validation.py`; plugin and policy names are checked against the scheduler's
registries when it builds its policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .peers import PeersConfig
from .scaling import ScalingConfig
from .spares import SparesConfig

__all__ = ["AdminKeyConfig", "AdminKeysFile", "AgingConfig", "PolicyProfileConfig", "SchedulerConfig"]


@dataclass
class AgingConfig:
    """Seconds a request waits in a class before it moves up one class.

    30 s is the figure from the articles kvmesh was founded on: long enough
    that interactive traffic keeps its edge, short enough that batch work is
    never starved. Aging repeats: a P2 request reaches P0 after 60 s.
    """

    # Seconds a P1 request waits before it moves up to P0. Bounds: > 0.
    p1_seconds: float = 30.0
    # Seconds a P2 request waits before it moves up to P1 (then p1_seconds
    # more to reach P0). Bounds: > 0.
    p2_seconds: float = 30.0


@dataclass
class PolicyProfileConfig:
    """A placement policy as a list of registered plugins
    (services/scheduler/placement/registry.py names them)."""

    # Filters applied in order; each keeps the engines that pass.
    filters: list[str] = field(
        default_factory=lambda: [
            "model", "serving", "fresh", "not_draining", "not_excluded",
            "fits_context", "has_room", "lease_slots",
        ]
    )
    # Scorer name -> weight (>= 0); the framework clamps each score to
    # [0, 1] and takes the weighted mean.
    scorers: dict[str, float] = field(default_factory=lambda: {"load": 1.0})
    # Picker name: chooses one engine from the scored ones.
    picker: str = "max_score"
    # Where cached-prefix knowledge comes from: "kv_index" (engines' KV
    # events), "kv_inflight" (those plus the prefixes of requests placed but
    # not yet reported, for scheduler.inflight_prefix_seconds), "approx"
    # (where this policy sent each prefix) or "none".
    prefix_source: Literal["kv_index", "kv_inflight", "approx", "none"] = "kv_index"


@dataclass
class AdminKeyConfig:
    """An operator's token for the scheduler's Admin service
    (protos/kvmesh/v1/admin.proto). Only its SHA-256 is stored
    (`kvmesh key hash TOKEN`)."""

    # 64 hex digits (case and surrounding blanks ignored); unique per key.
    sha256: str = ""
    # Required: who holds the key; every admin call is logged with it and
    # the first 12 hex digits of the digest.
    name: str = ""


@dataclass
class AdminKeysFile:
    """The document `scheduler.admin_keys_file` names."""

    admin_keys: list[AdminKeyConfig] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    """The scheduler process: its ports, admission limits, placement and
    queue policies. Names of policies are checked against the scheduler's
    registries when it starts (the config cannot know them)."""

    host: str = "127.0.0.1"
    # gRPC port (0 = any free port) and Prometheus port (0 = off); <= 65535.
    port: int = 50051
    metrics_port: int = 9101
    # Placement policy by registered name (services/scheduler/placement/).
    policy: str = "predicted_ttft"
    # Which registered queue fairness policy the scheduler uses: which
    # tenant's request goes next. Round robin keeps one tenant's burst from
    # starving the others.
    queue_fairness: str = "round_robin_tenants"
    # Which registered queue ordering policy the scheduler uses: which of a
    # tenant's requests goes next (FIFO within a class, after aging).
    queue_ordering: str = "fifo"
    aging: AgingConfig = field(default_factory=AgingConfig)
    # Most requests queued per class [P0, P1, P2]; past it -> 429. Three
    # caps, each >= 0.
    queue_caps: list[int] = field(default_factory=lambda: [1000, 2000, 10000])
    # Longest wait per class in seconds before -> 503 expired [P0, P1, P2].
    # Three TTLs, each > 0.
    queue_ttl_seconds: list[float] = field(default_factory=lambda: [60.0, 300.0, 3600.0])
    # Most requests one tenant may have queued (all classes). >= 0.
    tenant_queue_cap: int = 2000
    # Most Batch API lines (AdmitRequest.batch) queued, all tenants; past it
    # -> 429 for the line (the gateway's batch runner retries it later).
    # Batch lines count here INSTEAD of queue_caps[2] and tenant_queue_cap,
    # so a 50k-line batch can neither fill the P2 queue nor a tenant's room
    # for its interactive requests, nor displace any of them. 10000 = the P2
    # cap: a runner keeps far fewer in flight, this is the flood guard. >= 0.
    batch_queue_cap: int = 10000
    # An engine with no report for this long is not placed on. > 0, and
    # above engines' report_interval_seconds.
    stale_report_seconds: float = 2.0
    # sticky_until_saturated: keep a prefix on its engine unless that engine's
    # estimated queueing exceeds the best cold engine's by this many seconds.
    # >= 0.
    sticky_margin_seconds: float = 0.5
    # Tokens of decode room reserved per placement beyond the prompt,
    # capped by max_tokens; keeps a burst from overfilling an engine. >= 0.
    decode_headroom_tokens: int = 256
    # Placements an engine may have in flight beyond max_running; they wait
    # in the engine's own queue, which keeps its batch full between reports.
    # >= 0.
    engine_queue_slack: int = 2
    # Of those lease slots (max_running + engine_queue_slack), how many per
    # engine only P0 may take. Without them a P0 arriving at a saturated
    # engine waits here until any request finishes, and by then the batch
    # work already queued on the engine takes the freed running slot; with
    # one kept free, the P0 goes to the engine at once and is first in its
    # priority queue for the next slot. >= 0; placement never reserves more
    # than an engine's lease slots - 1, whatever this says.
    p0_reserved_leases: int = 1
    # Classes whose requests may preempt running work of a lower class when
    # they cannot be placed at once: the scheduler ends a lower-class lease
    # on the engine where the newcomer runs best and gives the slot to the
    # newcomer; the preempted request keeps its stream and its tokens, goes
    # back to its queue with its arrival time and continues later from the
    # next token. [0] = interactive requests never wait behind batch work;
    # add 1 to let P1 preempt P2 too; [] = no preemption. Values in {0, 1, 2}.
    # For these classes Batch API lines' slots and blocks also count as room
    # in placement, so such a request keeps its warm engine and a batch line
    # there yields (scheduler/batch_yield.py).
    preempt_classes: list[int] = field(default_factory=lambda: [0])
    # Times one request may be preempted; after that it is protected and runs
    # to its end, so a batch request under a steady interactive stream still
    # finishes (with aging, no request starves). >= 0; 0 = never preempt.
    max_preemptions: int = 2
    # Seconds between Queued position updates to each waiting request. > 0.
    queued_update_seconds: float = 1.0
    # Retry-after (Little's law: queue ahead / recent dispatch rate) is
    # clamped to [min, max] seconds: below 1 s a client would hammer a full
    # queue; above 60 s it would give up on a queue that is merely busy.
    # With no dispatch seen in the window the max is given. 0 < min <= max.
    retry_after_min_seconds: float = 1.0
    retry_after_max_seconds: float = 60.0
    # Seconds of placements the dispatch rate is measured over. 30 s smooths
    # bursts yet follows a change of load within one aging period. Bounds: > 0.
    dispatch_rate_window_seconds: float = 30.0
    # After start-up the scheduler queues requests for models no engine has
    # registered yet for this long (engines reconnect with backoff after a
    # scheduler restart); later such requests are rejected NO_ENGINE at once.
    # >= 0.
    engine_grace_seconds: float = 10.0
    # A stream whose engine died mid-answer while no other engine serves its
    # model (every one dead or restarting at once) waits, with heartbeats, for
    # one to return this long after the model was last served; then it is
    # refused NO_ENGINE. A replacement that excludes every engine of its model
    # waits this long after its Replace (a restarted process of an excluded
    # engine is not excluded), whatever its class TTL. Refusing it at once would lose the text it already
    # streamed; 120 s covers a vLLM engine's restart (~45 s on CPU, 30-120 s
    # with a large model on a GPU). >= 0.
    engine_return_seconds: float = 120.0
    # Seconds between housekeeping passes (aging promotions, TTL expiry,
    # stale engines). Dispatch itself is event-driven; this pass only catches
    # what time alone changes. 0.1 s keeps TTL and aging within 100 ms. > 0.
    tick_seconds: float = 0.1
    # Estimate of an engine's prefill speed at weight 1, in prompt tokens/s,
    # used to turn an engine's queued prompt tokens into seconds of queueing
    # (sticky_until_saturated). 20k tok/s matches the sim's default cost model
    # (the calibrated A100 profile at speed_factor 4 prefills ~4,700).
    # predicted_ttft uses each engine's own measured speed (LoadReport 310)
    # and this only until the engine has measured one. > 0.
    prefill_tokens_per_second: float = 20000.0
    # predicted_ttft: a hot prefix spreads to a cold engine only when its
    # warm engines' predicted TTFT exceeds the cold one's (full prefill
    # counted) by this many seconds, and an extra warm copy takes requests
    # only while the preferred one is this much worse (hysteresis both
    # ways). >= 0.
    predicted_ttft_margin_seconds: float = 0.1
    # kv_inflight prefix source: seconds a placed request's prefix counts as
    # about to be cached on its engine when no KV event has shown it yet.
    # > 0.
    inflight_prefix_seconds: float = 5.0
    # Seconds a request holds a batch slot before anything is measured; the
    # per-engine figure then follows an EWMA of observed lease durations. > 0.
    initial_service_seconds: float = 2.0
    # Most prefix hashes `prefix_approx` remembers (LRU); bounds its memory
    # when it cannot see engines' evictions. 1M hashes ~ 100 MB worst case.
    # > 0.
    approx_prefix_capacity: int = 200_000
    # Placement scores candidates from indexes instead of every engine of the
    # model (services/scheduler/placement/candidates.py): the engines holding
    # the request's prefix plus, for each figure the policy ranks on (load,
    # KV headroom, cache spread, queueing, predicted start), this many best
    # engines by it. A decision then costs O(this) instead of O(engines):
    # measured 52 ms at 1,024 engines with a full scan (BENCHMARKS.md,
    # "Control plane capacity"). 8 covers the near-ties the pickers break by
    # score with room to spare, while four figures x 8 stays under ~40 views.
    # A model with at most 2 x this many engines is scanned whole (exact,
    # as cheap). 0 = always scan every engine. >= 0.
    placement_candidates: int = 8
    # Seed for the random tie-break among equally scored engines (shuffle,
    # then stable sort), so runs are reproducible.
    placement_seed: int = 0
    # Extra or overriding placement policies by name; see
    # services/scheduler/placement/policies.py for the built-in ones.
    policy_profiles: dict[str, PolicyProfileConfig] = field(default_factory=dict)
    # Tokens of the Admin service (drain engines, pause classes, change the
    # policy at run time; `kvmesh admin`). None by default, and then the
    # Admin service refuses every call: never open unless configured.
    # `kvmesh up` adds one it generates for its run and prints.
    admin_keys: list[AdminKeyConfig] = field(default_factory=list)
    # More admin keys from a YAML file (`admin_keys:` list, entries as
    # above), read when the scheduler starts: on Kubernetes a mounted
    # Secret. Relative paths are relative to the repository root. "" = none.
    admin_keys_file: str = ""
    # The greatest engine incarnation seen per engine id, kept in this file
    # so the fence against a stale engine process (an old process of a
    # rescheduled engine, back after a partition) survives a scheduler
    # restart; every scheduler naming the same file shares it
    # (services/scheduler/incarnation_store.py), so give each mesh its own:
    # two meshes' engines of one id would fence each other. "" = <run_dir>/
    # scheduler-incarnations.json. On Kubernetes the default run_dir is the
    # pod's emptyDir: it outlives a container restart, not the pod.
    incarnations_file: str = ""
    # Keep that record in this Redis instead (redis://host:port/db,
    # rediss:// for TLS, unix:///path.sock), shared by schedulers on several
    # hosts (e.g. the gateways' response-cache Redis; one hash,
    # kvmesh:scheduler:incarnations: meshes sharing a Redis take a database
    # each, the /db of the URL). "" = the file above.
    incarnations_redis_url: str = ""
    # Warm spares per model, their promotion and return (spares.py).
    spares: SparesConfig = field(default_factory=SparesConfig)
    # The scaling policy: the engines each model needs, published for an
    # actuator (scaling.py; services/scheduler/scaling/).
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    # The other scheduler replicas and how this one leaves room to their more
    # urgent requests (peers.py; services/scheduler/peer_heads.py).
    peers: PeersConfig = field(default_factory=PeersConfig)
