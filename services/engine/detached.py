"""Stream resumption, engine side: who reads a generation, and the
generations kept after their caller vanished (README "Resuming a stream").

A generation is read by ONE transport call at a time, its owner
(`Attachment`). When the owner leaves:
- having delivered the final output, or after a polite `cancel` from its
  caller (the gateway's client went away): the generation ends as always;
- otherwise (the call broke: the gateway died or its link did) the
  generation is DETACHED: it keeps running in the backend, its outputs
  merge in its `DeltaBuffer` (nothing is lost, nothing waits), and it is
  cancelled -- KV freed -- if nobody resumes it within `grace_seconds`.
A resume (`attach` of a live generation) takes ownership: a detached one
stops its expiry timer; one still owned by another call (a partitioned
gateway that has not noticed yet) ends that call (its task is cancelled and
told it was superseded) before the new owner reads anything. Every output
the transport took is in the generation's `OutputRecord`, so the new owner
replays it from the first delta and then continues live.

Ownership: all of it runs on the event loop thread; `Keeper` alone changes
who owns what, in `attach` and `leave`, each called once per call.

Direction: the runtime (services/engine/runtime.py) builds its `Keeper` and
hands it what it needs -- how to look a live generation up and whether a
vanished caller's generation may be kept now -- so this module never reaches
back into the runtime; it knows a generation only as a `KeptGeneration`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest
from services.engine.errors import EngineError

__all__ = ["Attachment", "KeptGeneration", "Keeper", "OutputRecord", "UnknownGeneration"]

log = logging.getLogger(__name__)

# How long a resuming call waits for the call it supersedes to let go.
_TAKEOVER_SECONDS = 5.0
# How long a new placement waits for a live owner to let go before it is a
# duplicate: a preempted or migrated request re-placed here at once can
# arrive on its new call before the old call's `cancel` (another HTTP/2
# stream) is read. A true duplicate is refused that much later; the
# scheduler refuses most of them at admission anyway.
_RELEASE_GRACE_SECONDS = 1.5


class UnknownGeneration(EngineError):
    """No live generation under this id (never here, finished, or expired) -> NOT_FOUND."""


@dataclass
class OutputRecord:
    """Every output a generation's transport took: the deltas (outputs with
    tokens, text or logprobs), in order, and the final one."""

    deltas: list[GenerationOutput] = field(default_factory=list)
    final: GenerationOutput | None = None

    def add(self, out: GenerationOutput) -> None:
        if out.token_ids or out.text or out.logprobs:
            self.deltas.append(out)
        if out.finish_reason is not None:
            self.final = out


@dataclass(eq=False)
class Attachment:
    """One transport call's ownership of a generation."""

    task: asyncio.Task[object] | None
    # The caller said `cancel`: the generation ends, it is not kept.
    polite: bool = False
    # A resuming call took the generation over: this call ends ABORTED.
    superseded: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)


class KeptGeneration(Protocol):
    """What the keeper needs of a generation (the runtime's `Generation`)."""

    request: GenerationRequest
    handed_over: bool

    @property
    def ended(self) -> bool: ...

    def cancel(self, message: str) -> None: ...

    def hand_over(self, message: str) -> None: ...

    def close(self) -> None: ...


G = TypeVar("G", bound=KeptGeneration)


class Keeper(Generic[G]):
    """The runtime's owners and detached generations (module docstring).

    `live(request_id)` is the runtime's live generation under that id (None
    once it let go of it); `may_keep()` says whether a generation whose caller
    vanished may be kept for a resume now (False once the engine failed or
    is stopping: nobody could resume it here)."""

    def __init__(self, live: Callable[[str], G | None], may_keep: Callable[[], bool],
                 grace_seconds: float) -> None:
        self._live = live
        self._may_keep = may_keep
        self.grace_seconds = grace_seconds
        self._owners: dict[str, Attachment] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @property
    def detached_count(self) -> int:
        return len(self._timers)

    def find(self, request_id: str, prompt: list[int]) -> G:
        """The live generation to resume; its original prompt must be `prompt`."""
        generation = self._live(request_id)
        if generation is None:
            raise UnknownGeneration(
                f"no generation {request_id!r} to resume here: it finished, expired or never ran")
        request = generation.request
        original = request.prompt_token_ids[:len(request.prompt_token_ids) - request.resumed_tokens]
        if original != prompt:
            raise InvalidRequest(f"the resumed request {request_id!r} has another prompt than the original")
        return generation

    async def attach(self, generation: G) -> Attachment:
        """The calling task owns `generation` from now on; a previous owner
        is ended first (superseded)."""
        request_id = generation.request.request_id
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
            log.info("request %s: detached generation resumed", request_id)
        mine = Attachment(asyncio.current_task())
        previous, self._owners[request_id] = self._owners.get(request_id), mine
        if previous is not None and previous.task is not None and not previous.released.is_set():
            log.info("request %s: resumed by a new call; ending the previous one", request_id)
            previous.superseded = True
            previous.task.cancel()
            try:
                async with asyncio.timeout(_TAKEOVER_SECONDS):
                    await previous.released.wait()
            except TimeoutError:
                log.warning("request %s: the superseded call did not let go in time", request_id)
        return mine

    async def make_way(self, request_id: str) -> bool:
        """A new placement of `request_id` arrived while a generation under
        that id is still here: end the old one and wait for the backend to let
        go of it, if it is stale -- detached (its caller vanished), or ended
        and only held for an acknowledgement or for the backend to let go (a
        preempted request placed here again at once; a live caller gets
        _RELEASE_GRACE_SECONDS to let go first). False: it is running for a
        live caller, a true duplicate."""
        generation = self._live(request_id)
        if generation is None:
            return True
        owner = self._owners.get(request_id)
        if owner is not None and not owner.released.is_set() and not generation.ended:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RELEASE_GRACE_SECONDS):
                    await owner.released.wait()
            if not owner.released.is_set() and not generation.ended:
                return False
            generation = self._live(request_id)
            if generation is None:
                return True
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        log.info("request %s: placed here again; ending its stale generation first", request_id)
        generation.cancel("superseded by a new placement of the same request")
        generation.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_TAKEOVER_SECONDS):
                while self._live(request_id) is generation:  # noqa: ASYNC110 - rare path
                    await asyncio.sleep(0.02)
        return self._live(request_id) is None

    def leave(self, generation: G, mine: Attachment, delivered: bool) -> None:
        """The owning call ends; `delivered`: its caller got the final output
        (or an error status). Ends, detaches or (superseded) leaves it be."""
        mine.released.set()
        request_id = generation.request.request_id
        if self._owners.get(request_id) is not mine:
            return  # superseded: the new owner has it
        del self._owners[request_id]
        if (delivered or mine.polite or self.grace_seconds <= 0 or generation.handed_over
                or not self._may_keep()):
            generation.cancel("the client closed the call")  # no-op once finished
            generation.close()
            return
        log.info("request %s: its caller vanished; kept %.0f s for a resume", request_id, self.grace_seconds)
        self._timers[request_id] = asyncio.get_running_loop().call_later(
            self.grace_seconds, self._expire, generation)

    def _expire(self, generation: G) -> None:
        request_id = generation.request.request_id
        self._timers.pop(request_id, None)
        log.info("request %s: not resumed within %.0f s; cancelled", request_id, self.grace_seconds)
        generation.cancel(f"not resumed within {self.grace_seconds:g} s after its caller vanished")
        generation.close()

    def expire_all(self) -> None:
        """End every detached generation now (the engine stops)."""
        for request_id in list(self._timers):
            timer = self._timers.pop(request_id)
            timer.cancel()
            generation = self._live(request_id)
            if generation is not None:
                generation.hand_over("engine stopping; its detached generation cannot be resumed here")
                generation.close()
