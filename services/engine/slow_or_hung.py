"""Past the hang bound: hung, or slow but alive?

A backend holding requests without output past its hang bound (liveness.py)
is hung -- unless its processes are still running or waiting to run. On a
saturated machine a healthy vLLM core can be silent that long: the other
engine's restart (model load, compilation) and a killed process's teardown
on the same pinned core stalled a SmolLM2 engine for 30 s here, and
`scripts/bench_vllm.py` lost its only engine between rounds while `vllm
serve` ran on the core both share. Restarting such an engine costs a
minute of cold start and, on a small fleet, every engine at once.

So before a silence past the bound is called a hang, the backend's own
processes are asked (`EngineBackend.activity`: vLLM's core and worker,
from /proc):

- one of them stopped (SIGSTOP; a debugger): hung now -- it cannot progress;
- their threads ran or waited in a run queue for at least
  MIN_RUNNABLE_SHARE of one core over the last ACTIVITY_WINDOW_SECONDS:
  slow, not hung -- given up to `busy_multiple` x the bound;
- less: hung (blocked on what will not come: a deadlock, a lost message).

A backend that cannot tell (`activity()` None: the simulator, which runs in
the engine's own loop) is hung at the bound, as before. A wedged GPU kernel
whose worker spins on its CPU looks busy: it is found at `busy_multiple` x
the bound, not at the bound -- the price of never restarting a slow engine.

`SlowOrHung` is pure -- fed times and activity samples, it answers -- so the
rule is tested on a fake clock. Ownership: one per LivenessWatch, on the
event loop thread.
"""

from __future__ import annotations

import logging

from services.engine.backend import BackendActivity

__all__ = ["ACTIVITY_WINDOW_SECONDS", "MIN_RUNNABLE_SHARE", "SlowOrHung"]

log = logging.getLogger(__name__)

# How long the activity is measured over before a verdict: long enough that
# a thread starved behind others on a core shows its waiting time.
ACTIVITY_WINDOW_SECONDS = 2.0
# A tenth of one core running or queued to run: a blocked tree shows ~0 (a
# few wake-ups), a computing or starved one >= 1 core's worth.
MIN_RUNNABLE_SHARE = 0.1


class SlowOrHung:
    def __init__(self, busy_multiple: float) -> None:
        self.busy_multiple = busy_multiple
        self._silence: float | None = None   # when the silence being judged began
        self._sample: tuple[float, float] | None = None  # (when, runnable seconds then)
        self._told = False  # "slow, not hung" logged for this silence

    def judge(self, hang: str, silence_began: float, bound: float, now: float,
              activity: BackendActivity | None) -> str | None:
        """`hang`: why the backend looks hung (silent since `silence_began`,
        past `bound`). The failure to report, or None: not (yet) a hang."""
        if activity is None:
            return hang
        if activity.stopped is not None:
            return f"{hang}; {activity.stopped}"
        ceiling = bound * self.busy_multiple
        if now - silence_began > ceiling:
            return (f"{hang}; its processes run, but past {self.busy_multiple:g} x the bound "
                    f"({ceiling:.1f} s) without output")
        if self._silence != silence_began or self._sample is None:
            self._silence, self._sample, self._told = silence_began, (now, activity.runnable_seconds), False
            return None
        when, before = self._sample
        if now - when < ACTIVITY_WINDOW_SECONDS:
            return None
        share = (activity.runnable_seconds - before) / (now - when)
        self._sample = (now, activity.runnable_seconds)
        if share < MIN_RUNNABLE_SHARE:
            return (f"{hang}; its processes ran or waited to run {share:.0%} of a core over the last "
                    f"{now - when:.1f} s: blocked, not slow")
        if not self._told:
            self._told = True
            log.warning("no output for %.1f s (bound %.1f s), but the backend's processes ran or waited to run "
                        "%.0f%% of a core over the last %.1f s: slow, not hung; a hang at %.1f s without output",
                        now - silence_began, bound, 100 * share, now - when, ceiling)
        return None
