"""One request's metrics, recorded at its start and its end -- never per
token: kvmesh's own (`kvmesh_gateway_e2e_request_latency_seconds`, prompt and
generation tokens, resumes) and the field's names (services/gateway/
field_metrics.py: OpenTelemetry GenAI, Gateway API Inference Extension).

`GenerationDriver.start` wraps each request's run with a meter; the meter
sees what the driver emits (the first delta, tokens relayed, the final
`Finished` with the request's usage) and how the run ended (finished, a
`GatewayError`, cancelled because the client left). Owned by the request's
pump task, like the run it wraps.

Time to first token for the GenAI series is the driver's (`_observe_delta`:
kvmesh's TTFT histogram); time per output token is (end - first token) /
(output tokens - 1), the semantic conventions' definition, successful
requests only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from services.common.clock import Clock
from services.gateway.errors import GatewayError
from services.gateway.events import Emit, Finished, QueuedUpdate, TextDelta
from services.gateway.jobs import Job
from services.gateway.metrics import GatewayMetrics, error_label

__all__ = ["RequestMeter"]

Run = Callable[[Emit], Awaitable[None]]


class RequestMeter:
    def __init__(self, metrics: GatewayMetrics, job: Job, clock: Clock) -> None:
        self._metrics = metrics
        self._job = job
        self._clock = clock
        self._first_token_at: float | None = None
        self._tokens = 0
        self._usage_output: int | None = None
        # The final `Finished` decides the outcome (the transport may cancel
        # the run after it, while the driver tidies up): None until seen,
        # then "" (ok) or the failed finish reason.
        self._finished: str | None = None
        self._resume_result: str | None = None if job.resume_from is not None else ""

    def wrap(self, run: Run) -> Run:
        ended = False

        async def metered(emit: Emit) -> None:
            async def observe(event: QueuedUpdate | TextDelta | Finished) -> None:
                nonlocal ended
                self._see(event)
                await emit(event)
                if isinstance(event, Finished) and event.final:
                    # Ends here, with the client's last event: the run only
                    # tidies up after it (event_stream.py), off the clock.
                    ended = True
                    self._ended("")

            self._started()
            error = "cancelled"
            try:
                await run(observe)
                error = ""
            except GatewayError as exc:
                error = error_label(exc.code, exc.kind.value)
                raise
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = type(exc).__name__
                raise
            finally:
                if not ended:
                    self._ended(error)

        return metered

    def _see(self, event: QueuedUpdate | TextDelta | Finished) -> None:
        if isinstance(event, TextDelta):
            if event.token_ids and self._first_token_at is None:
                self._first_token_at = self._clock.monotonic()
            self._tokens += len(event.token_ids)
            if self._resume_result is None:
                self._resume_result = "resumed"
        elif isinstance(event, Finished) and event.final:
            self._usage_output = event.usage.completion_tokens
            self._finished = "" if event.reason.ok else event.reason.value
            if self._resume_result is None:
                self._resume_result = "resumed"

    def _started(self) -> None:
        job, m = self._job, self._metrics
        child, model = m.child, job.model
        child(m.prompt_tokens, model, job.metric_labels[1]).inc(len(job.prompt_ids))
        child(m.field.gie_requests, model, model).inc()
        child(m.field.gie_running, model).inc()

    def _ended(self, error: str) -> None:
        """`error`: "" when the run finished (well or not: the `Finished`
        says), else the error code or "cancelled"."""
        job, m, f, child = self._job, self._metrics, self._metrics.field, self._metrics.child
        now = self._clock.monotonic()
        seconds = max(0.0, now - job.arrival_monotonic)
        route, priority, model = job.metric_labels
        output = self._usage_output if self._usage_output is not None else self._tokens
        child(f.gie_running, model).dec()
        child(m.e2e, route, priority, model).observe(seconds)
        child(m.generation_tokens, model, priority).inc(output)
        if self._resume_result != "":
            child(m.resumes, self._resume_result or error or "ended").inc()
        if self._finished is not None:
            error = self._finished
        if error == "cancelled":
            return  # the client left: no outcome to report in the field's series
        gen_ai = f.gen_ai_labels(route, model)
        child(f.gen_ai_request, *gen_ai, error).observe(seconds)
        child(f.gen_ai_operation, *gen_ai, error).observe(seconds)
        if error:
            child(f.gie_errors, model, model, error).inc()
            return
        child(f.gen_ai_tokens, *gen_ai, "input").observe(len(job.prompt_ids))
        child(f.gen_ai_tokens, *gen_ai, "output").observe(output)
        if self._first_token_at is not None:
            child(f.gen_ai_ttft, *gen_ai).observe(max(0.0, self._first_token_at - job.arrival_monotonic))
            if output > 1:
                child(f.gen_ai_tpot, *gen_ai).observe((now - self._first_token_at) / (output - 1))
        child(f.gie_duration, model, model).observe(seconds)
        child(f.gie_input, model, model).observe(len(job.prompt_ids))
        child(f.gie_output, model, model).observe(output)
