"""The scheduler's Admin service (protos/kvmesh/v1/admin.proto): the
operator's knobs over gRPC on the scheduler's own port, authenticated by
an admin token and logged.

Authentication: metadata `authorization: Bearer <token>`; the token's
SHA-256 must be one of `scheduler.admin_keys` / `scheduler.admin_keys_file`
(`AdminKeys`). No key configured -> every call PERMISSION_DENIED (the
service is never open by default); no or an unknown token ->
UNAUTHENTICATED. With mesh TLS on, the caller also needs the `admin`
certificate (mesh_tls.METHOD_ROLES). Every call, refused or not, is logged
at INFO (a refusal at WARNING) with who (the key's name and digest prefix),
what and the result.

Each knob becomes one core event (admin_knobs.py has the rules), handled
and delivered like any other, so the dispatch it allows happens at once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.config import SchedulerConfig
from services.common.config.loader import load_side_file
from services.common.config.scheduler import AdminKeyConfig, AdminKeysFile
from services.common.config.validation import check_admin_keys
from services.common.proto.kvmesh.v1 import admin_pb2, admin_pb2_grpc

from . import events as ev
from .core import SchedulerCore
from .records import NUM_CLASSES

__all__ = ["AdminKeys", "AdminServicer", "Caller", "load_admin_keys_file"]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]

_HOW_TO_CONFIGURE = (
    "the Admin service is off: no admin key is configured. Add one to the scheduler's config, "
    "`scheduler.admin_keys: [{name: <who>, sha256: <kvmesh key hash TOKEN>}]` (or a file named by "
    "scheduler.admin_keys_file), restart the scheduler and send `authorization: Bearer TOKEN`; "
    "`kvmesh up` makes one for its run and prints it")


@dataclass(frozen=True)
class Caller:
    name: str        # the key's holder (AdminKeyConfig.name)
    key_id: str      # first 12 hex digits of the token's SHA-256: safe to log

    def __str__(self) -> str:
        return f"{self.name} (key {self.key_id})"


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def load_admin_keys_file(config: SchedulerConfig) -> list[AdminKeyConfig]:
    """The keys of `scheduler.admin_keys_file` (none when unset), checked by
    the config's rules and against `scheduler.admin_keys`."""
    if not config.admin_keys_file:
        return []
    path = REPO_ROOT / config.admin_keys_file
    keys = load_side_file(AdminKeysFile, "scheduler.admin_keys_file", path).admin_keys
    check_admin_keys(keys, f"{path}: admin_keys", {k.sha256.strip().lower() for k in config.admin_keys})
    return keys


class AdminKeys:
    """Digest -> holder; immutable after construction (read once at start)."""

    def __init__(self, config: SchedulerConfig) -> None:
        keys = [*config.admin_keys, *load_admin_keys_file(config)]
        self._by_digest = {k.sha256.strip().lower(): k.name for k in keys}

    def __len__(self) -> int:
        return len(self._by_digest)

    def caller(self, metadata: Any) -> Caller:
        """Who sends this call's metadata; raises `_Refused` otherwise."""
        if not self._by_digest:
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, _HOW_TO_CONFIGURE)
        auth = next((str(v) for k, v in (metadata or ()) if k == "authorization"), "")
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                           "no admin token: send metadata 'authorization: Bearer <admin token>' "
                           "(kvmesh admin --token-file FILE, or $KVMESH_ADMIN_TOKEN)")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        name = self._by_digest.get(digest)
        if name is None:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                           "unknown admin token: its SHA-256 is not in scheduler.admin_keys")
        return Caller(name, digest[:12])


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """`deliver` is the Scheduler servicer's: commands reach the engines'
    Connect streams, notices the Admit streams."""

    def __init__(self, core: SchedulerCore, deliver: Callable[[ev.Outbox], None], keys: AdminKeys) -> None:
        self._core = core
        self._deliver = deliver
        self._keys = keys

    # ------------------------------------------------------------ the RPCs

    async def DrainEngine(self, request: admin_pb2.DrainEngineRequest, context: Any) -> admin_pb2.AdminReply:
        what = f"drain engine {request.engine_id!r}" + (" moving its running requests" if request.move_running else "")
        return await self._call(context, what, lambda: self._drain(request.engine_id, True, request.move_running))

    async def UndrainEngine(
        self, request: admin_pb2.UndrainEngineRequest, context: Any
    ) -> admin_pb2.AdminReply:
        return await self._call(context, f"undrain engine {request.engine_id!r}",
                                lambda: self._drain(request.engine_id, False, False))

    async def PauseClass(self, request: admin_pb2.ClassRequest, context: Any) -> admin_pb2.AdminReply:
        return await self._call(context, f"pause P{request.priority}", lambda: self._pause(request.priority, True))

    async def ResumeClass(self, request: admin_pb2.ClassRequest, context: Any) -> admin_pb2.AdminReply:
        return await self._call(context, f"resume P{request.priority}",
                                lambda: self._pause(request.priority, False))

    async def SetPlacementPolicy(
        self, request: admin_pb2.SetPlacementPolicyRequest, context: Any
    ) -> admin_pb2.AdminReply:
        return await self._call(context, f"set placement policy {request.policy!r}",
                                lambda: self._policy(request.policy))

    async def GetAdminState(self, request: admin_pb2.GetAdminStateRequest, context: Any) -> admin_pb2.AdminState:
        reply = await self._call(context, "get admin state", lambda: (False, "read"))
        return reply.state

    # ------------------------------------------------------------ the knobs

    def _drain(self, engine_id: str, drained: bool, move: bool) -> tuple[bool, str]:
        known = self._core.fleet.get(engine_id) is not None
        was = engine_id in self._core.fleet.admin_drained
        if not known and not was:
            ids = ", ".join(e.engine_id for e in self._core.fleet) or "none connected"
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"no engine {engine_id!r}; engines: {ids}")
        self._handle(ev.EngineDrainSet(engine_id, drained, move))
        if drained:
            moved = "; its running requests are handed over to other engines" if move and known else ""
            return not was, f"engine {engine_id} gets no new requests{moved}"
        return was, f"engine {engine_id} takes new requests again"

    def _pause(self, priority: int, paused: bool) -> tuple[bool, str]:
        if not 0 <= priority < NUM_CLASSES:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"priority must be 0 .. {NUM_CLASSES - 1} (P0 .. P{NUM_CLASSES - 1}), got {priority}")
        was = priority in self._core.waiting.paused
        self._handle(ev.ClassPaused(priority, paused))
        if paused:
            return not was, f"P{priority} is paused: its requests stay queued until resumed"
        return was, f"P{priority} is dispatched again"

    def _policy(self, name: str) -> tuple[bool, str]:
        names = self._core.policy_names()
        if name not in names:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"unknown placement policy {name!r}; known: {', '.join(names)}")
        was = self._core.policy.name
        self._handle(ev.PolicyChosen(name))
        return was != name, f"placement policy {name} (was {was})"

    def _handle(self, event: ev.Event) -> None:
        self._deliver(self._core.handle(event))

    def _state(self) -> admin_pb2.AdminState:
        return admin_pb2.AdminState(
            paused_priorities=sorted(self._core.waiting.paused),
            drained_engines=sorted(self._core.fleet.admin_drained),
            policy=self._core.policy.name, policies=self._core.policy_names())

    async def _call(
        self, context: Any, what: str, action: Callable[[], tuple[bool, str]]
    ) -> admin_pb2.AdminReply:
        try:
            caller = self._keys.caller(context.invocation_metadata())
        except _Refused as refused:
            log.warning("admin call refused (%s): %s: %s", refused.code.name, what, refused.message)
            await context.abort(refused.code, refused.message)
            raise  # unreachable: abort raises
        try:
            changed, message = action()
        except _Refused as refused:
            log.info("admin by %s: %s -> refused %s: %s", caller, what, refused.code.name, refused.message)
            await context.abort(refused.code, refused.message)
            raise
        log.info("admin by %s: %s -> %s%s", caller, what, message, "" if changed else " (no change)")
        return admin_pb2.AdminReply(changed=changed, message=message, state=self._state())
