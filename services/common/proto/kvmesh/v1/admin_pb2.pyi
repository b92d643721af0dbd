from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainEngineRequest(_message.Message):
    __slots__ = ("engine_id", "move_running")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MOVE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    move_running: bool
    def __init__(self, engine_id: _Optional[str] = ..., move_running: _Optional[bool] = ...) -> None: ...

class UndrainEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class ClassRequest(_message.Message):
    __slots__ = ("priority",)
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    priority: int
    def __init__(self, priority: _Optional[int] = ...) -> None: ...

class SetPlacementPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class GetAdminStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdminState(_message.Message):
    __slots__ = ("paused_priorities", "drained_engines", "policy", "policies")
    PAUSED_PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    DRAINED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    paused_priorities: _containers.RepeatedScalarFieldContainer[int]
    drained_engines: _containers.RepeatedScalarFieldContainer[str]
    policy: str
    policies: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paused_priorities: _Optional[_Iterable[int]] = ..., drained_engines: _Optional[_Iterable[str]] = ..., policy: _Optional[str] = ..., policies: _Optional[_Iterable[str]] = ...) -> None: ...

class AdminReply(_message.Message):
    __slots__ = ("changed", "message", "state")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    message: str
    state: AdminState
    def __init__(self, changed: _Optional[bool] = ..., message: _Optional[str] = ..., state: _Optional[_Union[AdminState, _Mapping]] = ...) -> None: ...
