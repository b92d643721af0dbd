"""Batch lines: requests the batch service (services/batch/submit.py) sends
through this gateway's own API for a batch's creator.

A batch line is an ordinary `/v1/chat/completions` or `/v1/completions`
request plus `X-Kvmesh-Batch-*` headers: the creator's key id (the line is
authorised and charged as that key: its models, its rate limits), the
batch's completion deadline, the line's request id, and whether it resumes
a generation its previous sender left. The job becomes P2 with
`AdmitRequest.batch` and `batch_deadline_unix` set. Batch lines bypass the
tenant queue caps, so the headers are honoured ONLY from a caller
presenting the batch service's internal credential, whose SHA-256 is
`batch.internal_key_sha256` or that of `batch.internal_key_file`'s content
(services/common/batch_credential.py; compared in constant time); any
`X-Kvmesh-Batch-*` header without it is refused (403 `batch_not_allowed`),
never ignored.

A batch line's generation outlives its connection: if the batch service
goes away mid-line, the driver detaches it as for a vanished gateway
(driver.py), so the next batch process resumes it (`job.resume_from = 0`:
every delta again, the whole output collected) within `resume.grace_seconds`.
Batch lines skip the response cache, as they always have.

The answer carries the line's timing (TIMING_HEADERS: queued or not, the
wait before its first token, its run time after) for the batch service's
pacing (services/batch/pacing.py).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.batch_credential import credential_digest
from services.common.clock import Clock
from services.common.config import MeshConfig
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.events import QueuedUpdate, TextDelta
from services.gateway.jobs import Job, request_id_from
from services.gateway.keys import KeyStore, Principal, api_key_from_headers

__all__ = ["BATCH_PRIORITY", "BatchLine", "BatchLines", "LineTiming"]

BATCH_PRIORITY = 2
_PREFIX = "x-kvmesh-batch-"
_KEY_ID, _DEADLINE = "x-kvmesh-batch-key-id", "x-kvmesh-batch-deadline"
_REQUEST_ID, _RESUME = "x-kvmesh-batch-request-id", "x-kvmesh-batch-resume"
_ADMIT_BY = "x-kvmesh-batch-admit-by"
# Mirrors services/batch/submit.py TIMING_HEADERS.
_QUEUED, _WAIT, _RUN = "X-Kvmesh-Batch-Queued", "X-Kvmesh-Batch-Wait-Seconds", "X-Kvmesh-Batch-Run-Seconds"


@dataclass(frozen=True)
class BatchLine:
    principal: Principal    # the batch creator's key
    request_id: str
    deadline_unix: float
    resume: bool
    admit_by_unix: float = 0.0   # 0 = not sent (a batch service older than the send fence)

    def check_admissible(self, now_unix: float) -> None:
        """Refuse a send past its admit-by time: its batch owner's lease has
        run out (services/batch/ownership.py), so another owner may have
        taken the batch over and resumed or rerun this line."""
        if self.admit_by_unix and now_unix > self.admit_by_unix:
            raise GatewayError(ErrorKind.CONFLICT, f"this batch line's sender lost its lease at "
                               f"{self.admit_by_unix:.3f} (now {now_unix:.3f}); the batch's new owner runs it",
                               code="batch_lease_expired")

    def apply(self, job: Job) -> None:
        job.batch, job.batch_deadline_unix = True, self.deadline_unix
        if self.resume:
            job.resume_from = 0   # every delta again: the output is collected whole


class BatchLines:
    """Immutable after construction: shared by every request."""

    def __init__(self, config: MeshConfig, keys: KeyStore) -> None:
        # internal_key_sha256, or the digest of the mounted key file (Kubernetes).
        self._digest = credential_digest(config.batch)
        self._keys = keys

    def read(self, headers: Mapping[str, str]) -> BatchLine | None:
        """None for an ordinary request (no batch header); a `BatchLine`
        for the batch service's; GatewayError for anyone else's."""
        if not any(name.lower().startswith(_PREFIX) for name in headers):
            return None
        raw = api_key_from_headers(headers)
        if not (self._digest and raw and hmac.compare_digest(hashlib.sha256(raw.encode()).hexdigest(),
                                                             self._digest)):
            raise GatewayError(ErrorKind.PERMISSION_DENIED, "X-Kvmesh-Batch-* headers are the batch service's "
                               "alone; remove them (use the Batch API: POST /v1/batches)", code="batch_not_allowed")
        principal = self._keys.principal_for(headers.get(_KEY_ID, ""))
        if principal is None:
            raise GatewayError(ErrorKind.UNAUTHENTICATED, "the API key that created this batch is no longer "
                               "configured", code="invalid_api_key")
        request_id = headers.get(_REQUEST_ID, "")
        deadline, admit_by = _seconds(headers.get(_DEADLINE, "")), _seconds(headers.get(_ADMIT_BY, "0"))
        if not (math.isfinite(deadline) and deadline > 0) or request_id_from(request_id) != request_id:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "a batch line needs a deadline (unix seconds) and a "
                               "request id", param=_DEADLINE)
        if not (math.isfinite(admit_by) and admit_by >= 0):
            raise GatewayError(ErrorKind.INVALID_REQUEST, "a batch line's admit-by time is unix seconds",
                               param=_ADMIT_BY)
        return BatchLine(principal, request_id, deadline, headers.get(_RESUME) == "1", admit_by)


def _seconds(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        return math.nan


class LineTiming:
    """What a line's events say of its wait and run, as response headers."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._started = clock.monotonic()
        self._first_token: float | None = None
        self._queued = False

    def see(self, event: object) -> None:
        if isinstance(event, QueuedUpdate):
            self._queued = True
        elif isinstance(event, TextDelta) and event.token_ids and self._first_token is None:
            self._first_token = self._clock.monotonic()

    def headers(self) -> dict[str, str]:
        ended = self._clock.monotonic()
        first = ended if self._first_token is None else self._first_token
        return {_QUEUED: "1" if self._queued else "0", _WAIT: f"{first - self._started:.3f}",
                _RUN: f"{ended - first:.3f}"}
