"""The sim's step statistics, as vLLM reports them (services/engine/
vllm_backend/stats.py), so a sim mesh shows the same engine series: each
step's wall time, tokens computed (prefill + decode) and preemptions; each
request's gap since its previous token (once per step that gave it one);
each finished request's queue / prefill / decode time (vLLM's
FinishedRequestStats: arrival -> first scheduled -> first token -> last
token).

Ownership: one `SimStepMeter` per `SimBackend`, called from its step loop and
`generate` on the event loop thread. Nothing is measured while no observer is
set.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.backend import RequestPhases, StepObserver
from services.engine.sim.core import RequestState, SimRequest, StepPlan

__all__ = ["SimStepMeter"]


@dataclass
class _Times:
    arrived: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float = 0.0


class SimStepMeter:
    def __init__(self) -> None:
        self.observer: StepObserver | None = None
        self._times: dict[SimRequest, _Times] = {}

    def arrived(self, req: SimRequest, now: float) -> None:
        if self.observer is not None:
            self._times[req] = _Times(now)

    def forget(self, req: SimRequest) -> None:
        self._times.pop(req, None)

    def before_apply(self, plan: StepPlan) -> dict[SimRequest, int]:
        """Tokens each request of the step had generated before it."""
        if self.observer is None:
            return {}
        return {req: req.generated for req in plan.entries}

    def after_step(self, plan: StepPlan, before: dict[SimRequest, int], started: float, now: float) -> None:
        observer = self.observer
        if observer is None:
            return
        observer.step(now - started, sum(plan.entries.values()), plan.preempted)
        for req in plan.entries:
            times = self._times.get(req)
            if times is None:
                continue
            if times.scheduled is None:
                times.scheduled = started
            if req.generated > before.get(req, req.generated):
                if times.first_token is None:
                    times.first_token = now
                else:
                    observer.inter_token(now - times.last_token)
                times.last_token = now
            if req.state is RequestState.FINISHED and times.first_token is not None:
                observer.request_phases(RequestPhases(
                    times.scheduled - times.arrived, times.first_token - times.scheduled,
                    times.last_token - times.first_token))
                del self._times[req]
