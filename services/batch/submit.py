"""One batch line through a gateway's own HTTP API: POST the line's body to
`/v1/chat/completions` or `/v1/completions` of `batch.gateway_url`, so it
rides the same pipeline as any request (the key's models and rate limits,
admission, placement, migration, preemption), and turn the answer into the
line's `Result`.

The line is sent non-streamed under the batch service's internal credential
with the creator's key id, the batch's completion deadline and the line's
request id (`LINE_HEADERS`; services/gateway/batch_lines.py honours them
only with that credential, and makes the job a batch line). A line whose
previous owner died mid-generation is RESUMED under its recorded request
id: the gateway re-attaches to the generation its engine kept
(`resume.grace_seconds`) and answers with the whole output;
`Outcome.RERUN` says it was gone. Each send carries an admit-by time
(ownership.py); a gateway's refusal past it is `Outcome.FENCED`. A connection that breaks after the line
was sent (its gateway died) is `Outcome.RESUME`: the same request id again,
on whichever gateway answers next.
"""

from __future__ import annotations

import enum
import json
import socket
import ssl
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from services.batch.output import response_line
from services.batch.pacing import Pace

__all__ = ["LINE_HEADERS", "TIMING_HEADERS", "Attempt", "LineExecutor", "MeshTls", "Outcome", "Result",
           "pace_of", "resumable"]

# The headers of a batch line (the gateway's side: services/gateway/batch_lines.py).
LINE_HEADERS = {"key_id": "X-Kvmesh-Batch-Key-Id", "deadline": "X-Kvmesh-Batch-Deadline",
                "request_id": "X-Kvmesh-Batch-Request-Id", "resume": "X-Kvmesh-Batch-Resume",
                "admit_by": "X-Kvmesh-Batch-Admit-By"}
# What the gateway says of a line's timing (its answer's headers).
TIMING_HEADERS = {"queued": "X-Kvmesh-Batch-Queued", "wait": "X-Kvmesh-Batch-Wait-Seconds",
                  "run": "X-Kvmesh-Batch-Run-Seconds"}
# A queue wait shorter than this is no signal whatever the line's length:
# the scheduler's own admission round trip and a step's wait take about as long.
_MIN_QUEUE_SIGNAL_SECONDS = 0.25
# Statuses worth another try later: the fleet was busy or away (429, 503:
# back off), or a generation failed (500, 502). A 504 is the line's own
# generation limit: the next try would end so too.
_BACK_OFF = (429, 503)
_RETRIABLE = (500, 502, *_BACK_OFF)
_GONE = ("resume_not_found", "resume_gap")
# A gateway's answer to a send past its admit-by time (services/gateway/batch_lines.py).
_FENCED = "batch_lease_expired"
# Connecting to a gateway; the answer itself may take as long as the line
# waits in the scheduler's queue (P2, until the batch's deadline).
_CONNECT_SECONDS = 10.0


class Outcome(enum.Enum):
    DONE = "done"        # `output` is the line's output line
    RETRY = "retry"      # a retriable failure: try again (a new attempt)
    RERUN = "rerun"      # a resume found no generation: run it afresh
    RESUME = "resume"    # the connection broke mid-line: the same request id again, resuming
    FENCED = "fenced"    # the gateway refused it past its admit-by time: the sender's lease ran out


@dataclass(frozen=True)
class Attempt:
    endpoint: str
    body: dict[str, Any]
    custom_id: str
    request_id: str
    deadline_unix: float
    resume: bool
    # Unix seconds after which no gateway may admit this send (its owner's
    # lease expiry less batch.admit_margin_seconds; ownership.py). 0 = none.
    admit_by_unix: float = 0.0


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    pace: Pace
    output: str = ""
    ok: bool = False
    tokens: int = 0
    message: str = ""


def pace_of(queued: bool, queue_wait: float, run_time: float) -> Pace:
    """A finished line's signal to the window (pacing.py). A line that waited
    in the scheduler's queue no longer than it then ran is a healthy backlog
    -- there was a line ready for each slot that freed -- so the window may
    grow; one that waited longer says the runner sends more than the fleet
    has room for."""
    return Pace.QUEUED if queued and queue_wait > max(run_time, _MIN_QUEUE_SIGNAL_SECONDS) else Pace.PLACED


def resumable(body: Mapping[str, Any]) -> bool:
    """One choice, no echo: a kept generation's whole output is the answer."""
    return body.get("n") in (None, 1) and not body.get("echo")


@dataclass(frozen=True)
class MeshTls:
    context: ssl.SSLContext
    server_name: str    # the name the gateways' certificates carry


class LineExecutor:
    """Sends lines to `gateway_url`; owns one HTTP client session (`close` it)."""

    def __init__(self, gateway_url: str, credential: str, tls: MeshTls | None = None) -> None:
        self._url = gateway_url.rstrip("/")
        self._auth = f"Bearer {credential}"
        self._session: aiohttp.ClientSession | None = None
        # With mesh TLS, a gateway's port takes mesh certificates only.
        self._tls: dict[str, Any] = {"ssl": tls.context, "server_hostname": tls.server_name} if tls else {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_SECONDS)
            # No connection limit of its own: the window (gate.py) bounds the lines in flight.
            connector = aiohttp.TCPConnector(limit=0, socket_factory=_resetting_socket)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    def headers(self, attempt: Attempt, key_id: str) -> dict[str, str]:
        headers = {"Authorization": self._auth, "Content-Type": "application/json",
                   LINE_HEADERS["key_id"]: key_id, LINE_HEADERS["deadline"]: f"{attempt.deadline_unix:.3f}",
                   LINE_HEADERS["request_id"]: attempt.request_id}
        if attempt.resume:
            headers[LINE_HEADERS["resume"]] = "1"
        if attempt.admit_by_unix:
            headers[LINE_HEADERS["admit_by"]] = f"{attempt.admit_by_unix:.3f}"
        return headers

    async def run(self, attempt: Attempt, key_id: str) -> Result:
        """The line under the key with id `key_id` (its creator's)."""
        if attempt.resume and not resumable(attempt.body):
            return Result(Outcome.RERUN, Pace.NEUTRAL, message="n > 1 / echo: not resumable")
        body = {k: v for k, v in attempt.body.items() if k not in ("stream", "stream_options")}
        try:
            async with self._client().post(self._url + attempt.endpoint, data=json.dumps(body),
                                           headers=self.headers(attempt, key_id), **self._tls) as response:
                status, raw, timing = response.status, await response.read(), response.headers
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return _broken(attempt, exc)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return Result(Outcome.RETRY, Pace.NEUTRAL, message=f"HTTP {status} from {self._url}: not a JSON object")
        if status == 200:
            usage = answer.get("usage") or {}
            return Result(Outcome.DONE, _pace(timing),
                          response_line(attempt.custom_id, attempt.request_id, 200, answer),
                          ok=True, tokens=int(usage.get("completion_tokens") or 0))
        return _refused(attempt, status, answer)


def _resetting_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """A socket the kernel resets (RST), not closes (FIN), when this process
    dies: Envoy stops reading an HTTP/1.1 client while its request waits
    for the answer, so a FIN would go unnoticed until the answer came --
    the gateway would finish the line for nobody and forget it, where a
    reset reaches it at once and it keeps the generation for the resume."""
    family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return sock


def _broken(attempt: Attempt, exc: Exception) -> Result:
    """No answer. Never connected: the line did not start; try again after
    a pause. Cut off after it was sent: its gateway may have died with the
    generation kept on its engine -- resume it under the same id."""
    message = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Result(Outcome.RETRY, Pace.REJECTED, message=message)
    return Result(Outcome.RESUME if resumable(attempt.body) else Outcome.RETRY, Pace.NEUTRAL, message=message)


def _refused(attempt: Attempt, status: int, answer: dict[str, Any]) -> Result:
    error = answer.get("error")
    code, message = (error.get("code"), str(error.get("message"))) if isinstance(error, dict) else (None, "")
    if code == _FENCED:
        return Result(Outcome.FENCED, Pace.NEUTRAL, message=message)
    if attempt.resume and code in _GONE:
        return Result(Outcome.RERUN, Pace.NEUTRAL, message=message)
    if code == "duplicate_request_id" and resumable(attempt.body):
        # Its id runs already: an earlier send of it (Envoy retried a reset) lives on. Re-attach.
        return Result(Outcome.RESUME, Pace.NEUTRAL, message=message)
    if status in _RETRIABLE:
        return Result(Outcome.RETRY, Pace.REJECTED if status in _BACK_OFF else Pace.NEUTRAL,
                      message=message or f"HTTP {status}")
    return Result(Outcome.DONE, Pace.NEUTRAL, response_line(attempt.custom_id, attempt.request_id, status, answer))


def _pace(headers: Mapping[str, str]) -> Pace:
    """From the gateway's timing of the line (TIMING_HEADERS)."""
    try:
        queued = headers.get(TIMING_HEADERS["queued"]) == "1"
        wait = float(headers.get(TIMING_HEADERS["wait"]) or 0.0)
        run = float(headers.get(TIMING_HEADERS["run"]) or 0.0)
    except ValueError:
        return Pace.NEUTRAL
    return pace_of(queued, wait, run)
