"""A request's choices: `n > 1` as n generations that share the prompt's KV,
and completions' `echo`. README "n > 1, echo, logit_bias".

How n runs: choice 0 is the request itself (admitted, queued, placed as
any). At its first event from the engine -- its prompt is prefilled then,
and the prompt's full KV blocks are in the engine's prefix cache -- choices
1..n-1 start as copies (`<request_id>-n<i>`), admitted with
`together_with` = the request: the scheduler leases each on the engine
choice 0 holds, without queueing (services/scheduler/core.py), so each
copy's prompt is a prefix-cache hit there and only the prompt's last
partial block is computed again (the last prompt token always is, as in
vLLM). That is vLLM's own n > 1 exactly: its V1 engine fans `n` out into
child requests that share the prompt through the prefix cache
(vllm/v1/engine/parallel_sampling.py). A seed is `seed + i` for choice i,
as vLLM does, so seeded choices differ.

Each choice is an ordinary generation (services/gateway/driver.py) of its
own: a migration moves each unfinished choice on from its own tokens, a
preemption requeues only the choice it hit, and each choice ends with its
own `Finished` (`choice` = i). The last choice to end sends the `final`
one, with the request's usage: the prompt counted once, the completions
summed, cached tokens the most any choice had. A choice that fails ends
the request (its error is the final event; the other choices are
cancelled).

Limits: no resume (`Last-Event-ID` / `ResumeFrom`) with n > 1 (refused by
the transports); if choice 0 finishes before its copies are admitted the
scheduler has no lease to join and they queue as usual (and may prefill
again elsewhere).

Ownership: a `Choices` runs in the request's one pump task
(event_stream.EventStream); each choice's generation runs in a child task
it owns and cancels when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from services.gateway.events import Emit, Finished, QueuedUpdate, TextDelta, Usage
from services.gateway.jobs import Job

__all__ = ["Choices", "copy_job"]

_ID_MAX = 128
_INT64_MAX = 2**63 - 1


class ChoiceRun(Protocol):
    async def run(self, emit: Emit) -> None: ...

    async def before_close(self) -> None: ...


def copy_job(job: Job, i: int) -> Job:
    """Choice i's job: its own id, the engine of `job`, its own seed."""
    suffix = f"-n{i}"
    sampling = job.sampling
    if sampling.seed is not None:
        seed = sampling.seed + i if sampling.seed <= _INT64_MAX - i else sampling.seed - i
        sampling = replace(sampling, seed=seed)
    return replace(
        job, request_id=job.request_id[: _ID_MAX - len(suffix)] + suffix, together_with=job.request_id,
        sampling=sampling, n=1, echo_text="", resume_from=None,
    )


class Choices:
    """The n choices of one job (n >= 1; also runs n = 1 with `echo`)."""

    def __init__(self, job: Job, new_run: Callable[[Job], ChoiceRun]) -> None:
        self._job = job
        self._new_run = new_run
        self._emit: Emit | None = None
        self._runs: list[ChoiceRun] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._echoed: set[int] = set()
        self._usage: list[Usage] = []

    async def before_close(self) -> None:
        for run in self._runs:
            with contextlib.suppress(Exception):
                await run.before_close()

    async def run(self, emit: Emit) -> None:
        self._emit = emit
        self._start(0, self._job)
        try:
            while True:
                pending = [t for t in self._tasks if not t.done()]
                if not pending:
                    break
                await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in self._tasks:
                    if task.done() and not task.cancelled():
                        error = task.exception()
                        if error is not None:
                            raise error
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, i: int, job: Job) -> None:
        run = self._new_run(job)
        self._runs.append(run)
        self._tasks.append(asyncio.create_task(run.run(self._emitter(i)), name=f"choice-{i}"))

    def _emitter(self, i: int) -> Emit:
        async def emit(event: QueuedUpdate | TextDelta | Finished) -> None:
            if self._emit is None:  # pragma: no cover - set by run
                raise RuntimeError("a choice emits only while the request runs")
            if isinstance(event, QueuedUpdate):
                if i == 0:  # the copies never queue behind choice 0
                    await self._emit(event)
                return
            if i == 0 and len(self._tasks) < self._job.n:
                for k in range(1, self._job.n):
                    self._start(k, copy_job(self._job, k))
            if self._job.echo_text and i not in self._echoed and (
                isinstance(event, TextDelta) or event.reason.ok
            ):
                self._echoed.add(i)
                await self._emit(TextDelta(self._job.echo_text, [], [], 0, i))
            if isinstance(event, TextDelta):
                await self._emit(replace(event, choice=i))
            else:
                await self._emit(self._finished(i, event))
        return emit

    def _finished(self, i: int, event: Finished) -> Finished:
        self._usage.append(event.usage)
        final = len(self._usage) == self._job.n or not event.reason.ok
        usage = event.usage
        if final:
            usage = Usage(
                prompt_tokens=len(self._job.prompt_ids),
                completion_tokens=sum(u.completion_tokens for u in self._usage),
                cached_tokens=max(u.cached_tokens for u in self._usage),
            )
        return replace(event, usage=usage, choice=i, final=final)
