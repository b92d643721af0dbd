from services.common.proto.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "lease_id", "resumed_tokens", "delta_offset", "ack_final", "trace_context", "scheduler_replica")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ACK_FINAL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    lease_id: str
    resumed_tokens: int
    delta_offset: int
    ack_final: bool
    trace_context: _containers.ScalarMap[str, str]
    scheduler_replica: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., lease_id: _Optional[str] = ..., resumed_tokens: _Optional[int] = ..., delta_offset: _Optional[int] = ..., ack_final: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., scheduler_replica: _Optional[str] = ...) -> None: ...

class CancelGeneration(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineGenerateMessage(_message.Message):
    __slots__ = ("request", "cancel", "resume")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    cancel: CancelGeneration
    resume: ResumeGeneration
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelGeneration, _Mapping]] = ..., resume: _Optional[_Union[ResumeGeneration, _Mapping]] = ...) -> None: ...

class ResumeGeneration(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineGenerateEvent(_message.Message):
    __slots__ = ("delta", "finished", "resumed")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    delta: EngineDelta
    finished: EngineFinished
    resumed: EngineResumed
    def __init__(self, delta: _Optional[_Union[EngineDelta, _Mapping]] = ..., finished: _Optional[_Union[EngineFinished, _Mapping]] = ..., resumed: _Optional[_Union[EngineResumed, _Mapping]] = ...) -> None: ...

class EngineResumed(_message.Message):
    __slots__ = ("prior_token_ids", "delta_offset")
    PRIOR_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    prior_token_ids: _containers.RepeatedScalarFieldContainer[int]
    delta_offset: int
    def __init__(self, prior_token_ids: _Optional[_Iterable[int]] = ..., delta_offset: _Optional[int] = ...) -> None: ...

class EngineDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "held_text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HELD_TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    held_text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., held_text: _Optional[str] = ...) -> None: ...

class EngineFinished(_message.Message):
    __slots__ = ("finish_reason", "usage", "message")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    message: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateClientFrame(_message.Message):
    __slots__ = ("stream", "message", "end", "hold", "release")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    stream: int
    message: EngineGenerateMessage
    end: bool
    hold: bool
    release: bool
    def __init__(self, stream: _Optional[int] = ..., message: _Optional[_Union[EngineGenerateMessage, _Mapping]] = ..., end: _Optional[bool] = ..., hold: _Optional[bool] = ..., release: _Optional[bool] = ...) -> None: ...

class GenerateClientFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[GenerateClientFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[GenerateClientFrame, _Mapping]]] = ...) -> None: ...

class StreamStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class GenerateServerFrame(_message.Message):
    __slots__ = ("stream", "message", "end", "status")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stream: int
    message: EngineGenerateEvent
    end: bool
    status: StreamStatus
    def __init__(self, stream: _Optional[int] = ..., message: _Optional[_Union[EngineGenerateEvent, _Mapping]] = ..., end: _Optional[bool] = ..., status: _Optional[_Union[StreamStatus, _Mapping]] = ...) -> None: ...

class GenerateServerFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[GenerateServerFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[GenerateServerFrame, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "model", "backend", "block_size", "total_blocks", "max_running", "max_model_len", "running", "waiting", "blocks_used", "cached_blocks", "serving")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    backend: str
    block_size: int
    total_blocks: int
    max_running: int
    max_model_len: int
    running: int
    waiting: int
    blocks_used: int
    cached_blocks: int
    serving: bool
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., backend: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., max_running: _Optional[int] = ..., max_model_len: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., blocks_used: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., serving: _Optional[bool] = ...) -> None: ...
