"""One batch line through the same pipeline as an HTTP request: front door
(key's models and rate limits, tokenization, context check) -> job ->
generation driver (admission, placement, migration, preemption) -> the
response body `/v1/chat/completions` or `/v1/completions` would have sent.

The job is P2 with `batch` set and the batch's completion deadline, under
the batch creator's key. A line whose previous owner died mid-generation is
first RESUMED under its recorded request id (the engine and scheduler keep
a generation whose gateway vanished for `resume.grace_seconds`, README
"Resuming a stream"); `Outcome.RERUN` says it was gone.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from services.common.openai_api.completions_output import ChatFormatter, CompletionFormatter, Formatter
from services.common.proto.kvmesh.v1 import common_pb2
from services.common.tool_calling.chat_output import ToolChatFormatter
from services.common.tool_calling.parsers import parser_for
from services.gateway.batch.inputs import ENDPOINTS
from services.gateway.batch.output import response_line
from services.gateway.batch.pacing import Pace
from services.gateway.driver import GenerationDriver
from services.gateway.errors import ErrorKind, GatewayError, finish_error, http_error
from services.gateway.events import Finished, FinishReason, QueuedUpdate, TextDelta
from services.gateway.frontdoor import Frontdoor
from services.gateway.keys import Principal

__all__ = ["BATCH_PRIORITY", "Attempt", "LineExecutor", "Outcome", "Result", "pace_of"]

BATCH_PRIORITY = 2
# Failures worth another try later: the fleet was busy, away or slow.
_RETRIABLE = {ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE, ErrorKind.GENERATION_FAILED,
              ErrorKind.INTERNAL}
# A queue wait shorter than this is no signal whatever the line's length:
# the scheduler's own admission round trip and a step's wait take about as long.
_MIN_QUEUE_SIGNAL_SECONDS = 0.25
_BACK_OFF = {ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE}


class Outcome(enum.Enum):
    DONE = "done"        # `output` is the line's output line
    RETRY = "retry"      # a retriable failure: try again (a new attempt)
    RERUN = "rerun"      # a resume found no generation: run it afresh


@dataclass(frozen=True)
class Attempt:
    endpoint: str
    body: dict[str, Any]
    custom_id: str
    request_id: str
    deadline_unix: float
    resume: bool


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    pace: Pace
    output: str = ""
    ok: bool = False
    tokens: int = 0
    message: str = ""


class LineExecutor:
    def __init__(self, frontdoor: Frontdoor, driver: GenerationDriver) -> None:
        self._frontdoor = frontdoor
        self._driver = driver

    async def run(self, attempt: Attempt, principal: Principal) -> Result:
        try:
            return await self._run(attempt, principal)
        except GatewayError as exc:
            if attempt.resume and exc.code in ("resume_not_found", "resume_gap"):
                return Result(Outcome.RERUN, Pace.NEUTRAL, message=exc.message)
            if exc.kind in _RETRIABLE:
                return Result(Outcome.RETRY, Pace.REJECTED if exc.kind in _BACK_OFF else Pace.NEUTRAL,
                              message=exc.message)
            error = http_error(exc)
            return Result(Outcome.DONE, Pace.NEUTRAL, response_line(attempt.custom_id, attempt.request_id,
                                                                    error.status, error.body))

    async def _run(self, attempt: Attempt, principal: Principal) -> Result:
        generation = ENDPOINTS[attempt.endpoint](attempt.body)
        admitted = await self._frontdoor.admit(generation, principal, BATCH_PRIORITY, attempt.request_id)
        job = admitted.job
        job.batch, job.batch_deadline_unix = True, attempt.deadline_unix
        if attempt.resume and job.n == 1 and not job.echo_text:
            job.resume_from = 0  # every delta again: the output is collected whole
        elif attempt.resume:
            return Result(Outcome.RERUN, Pace.NEUTRAL, message="n > 1 / echo: not resumable")
        tool_parser = parser_for(generation, self._frontdoor.model_tool_parser(generation.model))
        formatter: Formatter
        if tool_parser is not None:
            formatter = ToolChatFormatter(attempt.request_id, generation.model, False, tool_parser)
        elif attempt.endpoint == "/v1/chat/completions":
            formatter = ChatFormatter(attempt.request_id, generation.model, False)
        else:
            formatter = CompletionFormatter(attempt.request_id, generation.model, False)
        clock = self._driver.clock
        collected = _Collected(clock.monotonic())
        stream = self._driver.start(job)
        try:
            async for event in stream:
                collected.add(event, clock.monotonic())
        finally:
            await stream.aclose()
            self._frontdoor.settle(admitted, collected.tokens)
        return collected.result(attempt, formatter)


def pace_of(queued: bool, queue_wait: float, run_time: float) -> Pace:
    """A finished line's signal to the window (pacing.py). A line that waited
    in the scheduler's queue no longer than it then ran is a healthy backlog
    -- there was a line ready for each slot that freed -- so the window may
    grow; one that waited longer says the runner sends more than the fleet
    has room for."""
    return Pace.QUEUED if queued and queue_wait > max(run_time, _MIN_QUEUE_SIGNAL_SECONDS) else Pace.PLACED


class _Collected:
    """A non-streamed response's pieces, per choice (n > 1)."""

    def __init__(self, started: float) -> None:
        # When the line was sent, got its first token, ended (monotonic): its queue wait and run time.
        self.started = self.first_token = self.ended = started
        self.texts: dict[int, list[str]] = defaultdict(list)
        self.logprobs: dict[int, list[common_pb2.TokenLogprob]] = defaultdict(list)
        self.reasons: dict[int, str] = {}
        self.finished: Finished | None = None
        self.tokens = 0
        self.queued = False

    def add(self, event: object, now: float) -> None:
        if isinstance(event, TextDelta):
            if not self.tokens and event.token_ids:
                self.first_token = now
            self.tokens += len(event.token_ids)
            self.texts[event.choice].append(event.text)
            self.logprobs[event.choice].extend(event.logprobs)
        elif isinstance(event, Finished):
            self.ended = now
            self.finished = event
            self.reasons[event.choice] = event.reason.value
        elif isinstance(event, QueuedUpdate):
            self.queued = True

    def result(self, attempt: Attempt, formatter: Formatter) -> Result:
        pace = pace_of(self.queued, self.first_token - self.started, self.ended - self.first_token)
        finished = self.finished
        if finished is None or finished.reason in (FinishReason.ERROR, FinishReason.ABORT):
            return Result(Outcome.RETRY, pace, tokens=self.tokens,
                          message=finished.message if finished else "the generation ended without a result")
        failure = finish_error(finished.reason, finished.message)
        if failure is not None:  # a timeout: its limit would end the next try too
            error = http_error(failure)
            return Result(Outcome.DONE, pace, response_line(attempt.custom_id, attempt.request_id, error.status,
                                                            error.body), tokens=self.tokens)
        choices = [("".join(self.texts[i]), self.logprobs[i], self.reasons.get(i))
                   for i in range(max(self.reasons) + 1)]
        body = (formatter.response(*choices[0], finished.usage) if len(choices) == 1
                else formatter.response_n(choices, finished.usage))
        return Result(Outcome.DONE, pace, response_line(attempt.custom_id, attempt.request_id, 200, body),
                      ok=True, tokens=self.tokens)
