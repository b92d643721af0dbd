"""A request as it stands now: after a migration or a preemption it continues
from prompt + the tokens generated so far, with the token budgets that are
left. The one place that builds it, for both of its readers:

- the scheduler (`lease_link.LeaseLink`: `Replace`, `Requeue`, and an
  `AdmitRequest` sent again after a scheduler restart) -- its length, the
  max_tokens left, the prefix hashes of prompt + generated;
- the next engine (`driver._Generation`): the `EngineRequest` with those
  tokens, the sampling budgets left and how many were generated before.

Pure: it reads the job and the generated token ids (the driver's list,
never written here).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.openai_api.structured_outputs import structured_to_proto
from services.common.prefix_hash import block_hashes
from services.common.proto.kvmesh.v1 import engine_pb2, scheduler_pb2
from services.gateway.jobs import Job

__all__ = ["RequestNow"]


@dataclass(frozen=True)
class RequestNow:
    """`job` continued after `generated` (the token ids produced so far)."""

    job: Job
    generated: list[int]

    @property
    def tokens(self) -> list[int]:
        """What the next engine reads as its prompt."""
        return self.job.prompt_ids + self.generated

    @property
    def max_tokens_left(self) -> int:
        """May be 0 or less: every token arrived (only `finished` was lost)."""
        return self.job.max_tokens - len(self.generated)

    def prefix_hashes(self) -> list[int]:
        return block_hashes(self.tokens, self.job.hash_block_tokens)

    def admit_request(self, running_on: str = "") -> scheduler_pb2.AdmitRequest:
        """The Admit message to send again (a scheduler restart): a request
        that generated already asks for prompt + generated and what is left
        (at least 1); `running_on` re-attaches a request running there."""
        request = self.job.admit_request()
        if self.generated:
            request.prompt_tokens = len(self.job.prompt_ids) + len(self.generated)
            request.max_tokens = max(1, self.max_tokens_left)
            del request.prefix_hashes[:]
            request.prefix_hashes.extend(self.prefix_hashes())
        request.running_on_engine = running_on
        if running_on:
            request.resume = False  # re-attaching after a scheduler restart, not a client's resume
        return request

    def engine_request(self, lease_id: str, delta_offset: int) -> engine_pb2.EngineRequest:
        """The request for the placed engine: prompt + generated, the token
        budgets left, and how many of its prompt tokens were generated."""
        job, generated = self.job, self.generated
        sampling = job.sampling.to_proto(self.max_tokens_left)
        if job.sampling.min_tokens:
            sampling.min_tokens = max(0, job.sampling.min_tokens - len(generated))
        if job.structured is not None:
            sampling.structured.CopyFrom(structured_to_proto(job.structured))
        return engine_pb2.EngineRequest(
            request_id=job.request_id,
            prompt_token_ids=self.tokens,
            sampling=sampling,
            priority=job.priority,
            lease_id=lease_id,
            resumed_tokens=len(generated),
            delta_offset=delta_offset,
            ack_final=True,
            trace_context=dict(job.trace_context) if job.trace_context else None,
        )
