"""The Responses store on a fake clock: TTL, size bounds, per-key scoping."""

from __future__ import annotations

from services.common.clock import FakeClock
from services.common.config.responses import ResponsesConfig
from services.gateway.responses_store import ResponseStore


def response(response_id: str, text: str = "hi") -> dict[str, object]:
    return {"id": response_id, "object": "response", "output": [
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


def store(clock: FakeClock, **config: float) -> ResponseStore:
    return ResponseStore(ResponsesConfig(**config), clock)  # type: ignore[arg-type]  # settings as floats, the fields are int and float


def test_an_entry_lives_for_its_ttl() -> None:
    clock = FakeClock()
    s = store(clock, ttl_seconds=60)
    assert s.put("key-a", response("resp_1"), [{"type": "message", "role": "user", "content": "q"}])
    clock.advance(59.9)
    entry = s.get("key-a", "resp_1")
    assert entry is not None
    assert entry.conversation == [{"type": "message", "role": "user", "content": "q"},
                                  {"type": "message", "role": "assistant", "content": "hi"}]
    clock.advance(0.2)
    assert s.get("key-a", "resp_1") is None and len(s) == 0 and s.size_bytes == 0


def test_another_key_sees_nothing() -> None:
    s = store(FakeClock())
    s.put("key-a", response("resp_1"), [])
    assert s.get("key-b", "resp_1") is None
    assert not s.delete("key-b", "resp_1")
    assert s.get("key-a", "resp_1") is not None
    assert s.delete("key-a", "resp_1") and s.get("key-a", "resp_1") is None


def test_the_oldest_go_first_past_max_entries() -> None:
    s = store(FakeClock(), max_entries=2)
    for i in range(3):
        s.put("k", response(f"resp_{i}"), [])
    assert s.get("k", "resp_0") is None and s.get("k", "resp_1") and s.get("k", "resp_2")


def test_the_oldest_go_first_past_max_bytes() -> None:
    clock = FakeClock()
    probe = store(clock)
    probe.put("k", response("resp_x", "a" * 100), [])
    one = probe.size_bytes
    s = store(clock, max_bytes=2 * one + 10)
    for i in range(3):
        assert s.put("k", response(f"resp_{i}", "a" * 100), [])
    assert len(s) == 2 and s.size_bytes <= 2 * one + 10 and s.get("k", "resp_0") is None
    assert not s.put("k", response("resp_big", "a" * 10 * one), [])  # larger than the whole store
    assert len(s) == 2


def test_max_entries_zero_stores_nothing() -> None:
    s = store(FakeClock(), max_entries=0)
    assert not s.enabled and not s.put("k", response("resp_1"), []) and len(s) == 0
