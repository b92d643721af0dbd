from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RejectCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_CODE_UNSPECIFIED: _ClassVar[RejectCode]
    REJECT_CODE_QUEUE_FULL: _ClassVar[RejectCode]
    REJECT_CODE_TENANT_FULL: _ClassVar[RejectCode]
    REJECT_CODE_EXPIRED: _ClassVar[RejectCode]
    REJECT_CODE_NO_ENGINE: _ClassVar[RejectCode]
    REJECT_CODE_TOO_LARGE: _ClassVar[RejectCode]
    REJECT_CODE_INVALID: _ClassVar[RejectCode]
    REJECT_CODE_DRAINING: _ClassVar[RejectCode]
    REJECT_CODE_RESUME_UNKNOWN: _ClassVar[RejectCode]
    REJECT_CODE_RESUME_FORBIDDEN: _ClassVar[RejectCode]
REJECT_CODE_UNSPECIFIED: RejectCode
REJECT_CODE_QUEUE_FULL: RejectCode
REJECT_CODE_TENANT_FULL: RejectCode
REJECT_CODE_EXPIRED: RejectCode
REJECT_CODE_NO_ENGINE: RejectCode
REJECT_CODE_TOO_LARGE: RejectCode
REJECT_CODE_INVALID: RejectCode
REJECT_CODE_DRAINING: RejectCode
REJECT_CODE_RESUME_UNKNOWN: RejectCode
REJECT_CODE_RESUME_FORBIDDEN: RejectCode

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "model", "tenant", "priority", "prompt_tokens", "max_tokens", "prefix_hashes", "arrival_unix", "running_on_engine", "resume", "together_with", "trace_context", "batch", "batch_deadline_unix")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ON_ENGINE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TOGETHER_WITH_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    tenant: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    arrival_unix: float
    running_on_engine: str
    resume: bool
    together_with: str
    trace_context: _containers.ScalarMap[str, str]
    batch: bool
    batch_deadline_unix: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., arrival_unix: _Optional[float] = ..., running_on_engine: _Optional[str] = ..., resume: _Optional[bool] = ..., together_with: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., batch: _Optional[bool] = ..., batch_deadline_unix: _Optional[float] = ...) -> None: ...

class Replace(_message.Message):
    __slots__ = ("exclude_engines", "prompt_tokens", "max_tokens", "prefix_hashes")
    EXCLUDE_ENGINES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    exclude_engines: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, exclude_engines: _Optional[_Iterable[str]] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("seconds_ago",)
    SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    seconds_ago: float
    def __init__(self, seconds_ago: _Optional[float] = ...) -> None: ...

class RequestDone(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "delta_gaps_seconds", "max_delta_gap_seconds", "first_token")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DELTA_GAPS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTA_GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    delta_gaps_seconds: _containers.RepeatedScalarFieldContainer[float]
    max_delta_gap_seconds: float
    first_token: FirstToken
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., delta_gaps_seconds: _Optional[_Iterable[float]] = ..., max_delta_gap_seconds: _Optional[float] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ...) -> None: ...

class Requeue(_message.Message):
    __slots__ = ("prompt_tokens", "max_tokens", "prefix_hashes")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class AdmitClientMessage(_message.Message):
    __slots__ = ("request", "first_token", "done", "replace", "requeue")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    REQUEUE_FIELD_NUMBER: _ClassVar[int]
    request: AdmitRequest
    first_token: FirstToken
    done: RequestDone
    replace: Replace
    requeue: Requeue
    def __init__(self, request: _Optional[_Union[AdmitRequest, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., done: _Optional[_Union[RequestDone, _Mapping]] = ..., replace: _Optional[_Union[Replace, _Mapping]] = ..., requeue: _Optional[_Union[Requeue, _Mapping]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position", "estimated_wait_seconds", "priority")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    position: int
    estimated_wait_seconds: float
    priority: int
    def __init__(self, position: _Optional[int] = ..., estimated_wait_seconds: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class Placed(_message.Message):
    __slots__ = ("engine_id", "engine_address", "lease_id", "cached_tokens", "engine_incarnation", "first_token_seconds", "token_stall_seconds", "generation_seconds", "token_stall_p95_seconds", "scheduler_replica", "ends_at_done")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STALL_P95_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    ENDS_AT_DONE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_address: str
    lease_id: str
    cached_tokens: int
    engine_incarnation: int
    first_token_seconds: float
    token_stall_seconds: float
    generation_seconds: float
    token_stall_p95_seconds: float
    scheduler_replica: str
    ends_at_done: bool
    def __init__(self, engine_id: _Optional[str] = ..., engine_address: _Optional[str] = ..., lease_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., engine_incarnation: _Optional[int] = ..., first_token_seconds: _Optional[float] = ..., token_stall_seconds: _Optional[float] = ..., generation_seconds: _Optional[float] = ..., token_stall_p95_seconds: _Optional[float] = ..., scheduler_replica: _Optional[str] = ..., ends_at_done: _Optional[bool] = ...) -> None: ...

class Rejected(_message.Message):
    __slots__ = ("code", "message", "retry_after_seconds")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    code: RejectCode
    message: str
    retry_after_seconds: float
    def __init__(self, code: _Optional[_Union[RejectCode, str]] = ..., message: _Optional[str] = ..., retry_after_seconds: _Optional[float] = ...) -> None: ...

class Preempted(_message.Message):
    __slots__ = ("engine_id", "preemptions", "by_priority")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    preemptions: int
    by_priority: int
    def __init__(self, engine_id: _Optional[str] = ..., preemptions: _Optional[int] = ..., by_priority: _Optional[int] = ...) -> None: ...

class AdmitServerMessage(_message.Message):
    __slots__ = ("queued", "placed", "rejected", "preempted")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    queued: Queued
    placed: Placed
    rejected: Rejected
    preempted: Preempted
    def __init__(self, queued: _Optional[_Union[Queued, _Mapping]] = ..., placed: _Optional[_Union[Placed, _Mapping]] = ..., rejected: _Optional[_Union[Rejected, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ...) -> None: ...

class AdmitClientFrame(_message.Message):
    __slots__ = ("stream", "message", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    message: AdmitClientMessage
    end: bool
    def __init__(self, stream: _Optional[int] = ..., message: _Optional[_Union[AdmitClientMessage, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class AdmitClientFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[AdmitClientFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[AdmitClientFrame, _Mapping]]] = ...) -> None: ...

class AdmitServerFrame(_message.Message):
    __slots__ = ("stream", "message", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    message: AdmitServerMessage
    end: bool
    def __init__(self, stream: _Optional[int] = ..., message: _Optional[_Union[AdmitServerMessage, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class AdmitServerFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[AdmitServerFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[AdmitServerFrame, _Mapping]]] = ...) -> None: ...

class EngineHello(_message.Message):
    __slots__ = ("engine_id", "address", "model", "block_size", "total_blocks", "max_running", "weight", "max_model_len", "hash_block_tokens", "backend", "http_address", "incarnation", "model_revision", "scheduler_replicas")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    model: str
    block_size: int
    total_blocks: int
    max_running: int
    weight: float
    max_model_len: int
    hash_block_tokens: int
    backend: str
    http_address: str
    incarnation: int
    model_revision: str
    scheduler_replicas: int
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., max_running: _Optional[int] = ..., weight: _Optional[float] = ..., max_model_len: _Optional[int] = ..., hash_block_tokens: _Optional[int] = ..., backend: _Optional[str] = ..., http_address: _Optional[str] = ..., incarnation: _Optional[int] = ..., model_revision: _Optional[str] = ..., scheduler_replicas: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "blocks_used", "blocks_total", "cached_blocks", "serving", "queued_tokens", "request_ids", "prefix_cache_queries", "prefix_cache_hits", "prefill_tokens_per_second", "step_seconds", "step_token_budget", "backend_progress", "other_replica_generations", "placed_elsewhere", "kv_events")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    OTHER_REPLICA_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    PLACED_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    cached_blocks: int
    serving: bool
    queued_tokens: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefill_tokens_per_second: float
    step_seconds: float
    step_token_budget: int
    backend_progress: int
    other_replica_generations: int
    placed_elsewhere: _containers.RepeatedCompositeFieldContainer[PlacedPrompt]
    kv_events: _containers.RepeatedCompositeFieldContainer[KvEvents]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_total: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., serving: _Optional[bool] = ..., queued_tokens: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefill_tokens_per_second: _Optional[float] = ..., step_seconds: _Optional[float] = ..., step_token_budget: _Optional[int] = ..., backend_progress: _Optional[int] = ..., other_replica_generations: _Optional[int] = ..., placed_elsewhere: _Optional[_Iterable[_Union[PlacedPrompt, _Mapping]]] = ..., kv_events: _Optional[_Iterable[_Union[KvEvents, _Mapping]]] = ...) -> None: ...

class PlacedPrompt(_message.Message):
    __slots__ = ("prefix_hashes",)
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefix_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("seq", "hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineMessage(_message.Message):
    __slots__ = ("hello", "load", "kv_events", "kv_snapshot")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    hello: EngineHello
    load: LoadReport
    kv_events: KvEvents
    kv_snapshot: KvSnapshot
    def __init__(self, hello: _Optional[_Union[EngineHello, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., kv_snapshot: _Optional[_Union[KvSnapshot, _Mapping]] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("hand_over",)
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    hand_over: bool
    def __init__(self, hand_over: _Optional[bool] = ...) -> None: ...

class Resync(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerCommand(_message.Message):
    __slots__ = ("drain", "resync", "fence", "undrain")
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: Drain
    resync: Resync
    fence: Fence
    undrain: Undrain
    def __init__(self, drain: _Optional[_Union[Drain, _Mapping]] = ..., resync: _Optional[_Union[Resync, _Mapping]] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., undrain: _Optional[_Union[Undrain, _Mapping]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueState(_message.Message):
    __slots__ = ("priority", "tenant", "queued", "oldest_wait_seconds", "batch")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    priority: int
    tenant: str
    queued: int
    oldest_wait_seconds: float
    batch: bool
    def __init__(self, priority: _Optional[int] = ..., tenant: _Optional[str] = ..., queued: _Optional[int] = ..., oldest_wait_seconds: _Optional[float] = ..., batch: _Optional[bool] = ...) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("engine_id", "address", "model", "serving", "draining", "fresh", "running", "waiting", "blocks_used", "blocks_total", "blocks_reserved", "cached_blocks", "leases", "weight", "backend", "incarnation", "max_model_len", "drained_by_admin", "model_revision", "prefill_tokens_per_second", "step_seconds", "spare")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINED_BY_ADMIN_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    model: str
    serving: bool
    draining: bool
    fresh: bool
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    blocks_reserved: int
    cached_blocks: int
    leases: int
    weight: float
    backend: str
    incarnation: int
    max_model_len: int
    drained_by_admin: bool
    model_revision: str
    prefill_tokens_per_second: float
    step_seconds: float
    spare: bool
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., serving: _Optional[bool] = ..., draining: _Optional[bool] = ..., fresh: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_total: _Optional[int] = ..., blocks_reserved: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., leases: _Optional[int] = ..., weight: _Optional[float] = ..., backend: _Optional[str] = ..., incarnation: _Optional[int] = ..., max_model_len: _Optional[int] = ..., drained_by_admin: _Optional[bool] = ..., model_revision: _Optional[str] = ..., prefill_tokens_per_second: _Optional[float] = ..., step_seconds: _Optional[float] = ..., spare: _Optional[bool] = ...) -> None: ...

class ClassState(_message.Message):
    __slots__ = ("priority", "preemptions", "requeued", "preempted_now", "seconds_lost", "displaced", "protected", "batch_queued", "batch_preemptions")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_NOW_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LOST_FIELD_NUMBER: _ClassVar[int]
    DISPLACED_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_FIELD_NUMBER: _ClassVar[int]
    BATCH_QUEUED_FIELD_NUMBER: _ClassVar[int]
    BATCH_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    preemptions: int
    requeued: int
    preempted_now: int
    seconds_lost: float
    displaced: int
    protected: int
    batch_queued: int
    batch_preemptions: int
    def __init__(self, priority: _Optional[int] = ..., preemptions: _Optional[int] = ..., requeued: _Optional[int] = ..., preempted_now: _Optional[int] = ..., seconds_lost: _Optional[float] = ..., displaced: _Optional[int] = ..., protected: _Optional[int] = ..., batch_queued: _Optional[int] = ..., batch_preemptions: _Optional[int] = ...) -> None: ...

class SchedulerState(_message.Message):
    __slots__ = ("policy", "queues", "engines", "queued_total", "leases_total", "classes", "paused_priorities", "drained_engines", "deadlines", "replica", "peers", "scaling")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LEASES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    DRAINED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    policy: str
    queues: _containers.RepeatedCompositeFieldContainer[QueueState]
    engines: _containers.RepeatedCompositeFieldContainer[EngineState]
    queued_total: int
    leases_total: int
    classes: _containers.RepeatedCompositeFieldContainer[ClassState]
    paused_priorities: _containers.RepeatedScalarFieldContainer[int]
    drained_engines: _containers.RepeatedScalarFieldContainer[str]
    deadlines: _containers.RepeatedCompositeFieldContainer[DeadlineState]
    replica: str
    peers: _containers.RepeatedScalarFieldContainer[str]
    scaling: _containers.RepeatedCompositeFieldContainer[ModelScaling]
    def __init__(self, policy: _Optional[str] = ..., queues: _Optional[_Iterable[_Union[QueueState, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineState, _Mapping]]] = ..., queued_total: _Optional[int] = ..., leases_total: _Optional[int] = ..., classes: _Optional[_Iterable[_Union[ClassState, _Mapping]]] = ..., paused_priorities: _Optional[_Iterable[int]] = ..., drained_engines: _Optional[_Iterable[str]] = ..., deadlines: _Optional[_Iterable[_Union[DeadlineState, _Mapping]]] = ..., replica: _Optional[str] = ..., peers: _Optional[_Iterable[str]] = ..., scaling: _Optional[_Iterable[_Union[ModelScaling, _Mapping]]] = ...) -> None: ...

class ModelScaling(_message.Message):
    __slots__ = ("model", "desired", "current", "spares", "reason", "autoscaled")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALED_FIELD_NUMBER: _ClassVar[int]
    model: str
    desired: int
    current: int
    spares: int
    reason: str
    autoscaled: bool
    def __init__(self, model: _Optional[str] = ..., desired: _Optional[int] = ..., current: _Optional[int] = ..., spares: _Optional[int] = ..., reason: _Optional[str] = ..., autoscaled: _Optional[bool] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Undrain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeadlineState(_message.Message):
    __slots__ = ("kind", "model", "priority", "p95_seconds", "samples", "deadline_seconds", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    P95_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    model: str
    priority: int
    p95_seconds: float
    samples: int
    deadline_seconds: float
    source: str
    def __init__(self, kind: _Optional[str] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ..., p95_seconds: _Optional[float] = ..., samples: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class WatchQueueHeadsRequest(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: str
    def __init__(self, replica: _Optional[str] = ...) -> None: ...

class QueueHeads(_message.Message):
    __slots__ = ("replica", "heads")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    heads: _containers.RepeatedCompositeFieldContainer[QueueHead]
    def __init__(self, replica: _Optional[str] = ..., heads: _Optional[_Iterable[_Union[QueueHead, _Mapping]]] = ...) -> None: ...

class QueueHead(_message.Message):
    __slots__ = ("model", "priority", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    priority: int
    request_id: str
    def __init__(self, model: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...
