"""What the tracing e2e tests share: a free port for the in-process OTLP
receiver, and the spans it received, grouped by trace."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from services.launcher.ports import free_port

__all__ = ["OURS", "Spans", "attrs", "free_port"]

# kvmesh's own spans; any other span in a request's trace is Envoy's (or vLLM's).
OURS = ("gateway.request", "scheduler.admit", "engine.generate")


def value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def attrs(span: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in span.attributes}


class Spans:
    """Every span the receiver got, by trace id (hex)."""

    def __init__(self) -> None:
        self.by_trace: dict[str, list[Any]] = defaultdict(list)
        self.changed = asyncio.Event()

    async def collect(self, tap: Any) -> None:
        async for span in tap.stream_traces():
            self.by_trace[span.trace_id.hex()].append(span)
            self.changed.set()

    def of_request(self, request_id: str) -> list[Any]:
        return [s for spans in self.by_trace.values() for s in spans
                if attrs(s).get("kvmesh.request_id") == request_id]

    async def wait_for(self, request_id: str, timeout: float = 60.0, also: tuple[str, ...] = ()) -> list[Any]:
        """The spans of `request_id`'s trace once ours (gateway, scheduler,
        engine), Envoy's and those named in `also` arrived. Spans leave in
        batches (a few seconds)."""
        try:
            async with asyncio.timeout(timeout):
                while not self._complete(request_id, also):
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            pass
        ours = self.of_request(request_id)
        traces = {s.trace_id.hex() for s in ours}
        assert len(traces) == 1, f"{request_id}: spans in {len(traces)} traces: {[s.name for s in ours]}"
        trace = self.by_trace[traces.pop()]
        assert self._complete(request_id, also), f"{request_id}: incomplete trace {[s.name for s in trace]}"
        return list(trace)

    def _complete(self, request_id: str, also: tuple[str, ...]) -> bool:
        ours = self.of_request(request_id)
        if not ours or not {s.name for s in ours} >= set(OURS):
            return False
        trace = self.by_trace[ours[0].trace_id.hex()]
        return any(s.name not in OURS for s in trace) and {s.name for s in trace} >= set(also)
