"""The batch database (services/batch/store.py, ownership.py):
tenant scoping, pagination, the ownership lease and its epoch fence, on a
fake clock (times are passed in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types import Batch, FileObject

from services.batch.output import files_of, response_line
from services.batch.records import Page
from services.batch.store import BatchStore

TTL = 6.0


@pytest.fixture
def store(tmp_path: Path) -> BatchStore:
    return BatchStore(str(tmp_path / "batch.sqlite3"))


def _batch(batch_id: str, status: str = "in_progress") -> dict:
    return {"id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions", "errors": None,
            "input_file_id": "file-x", "completion_window": "24h", "status": status, "output_file_id": None,
            "error_file_id": None, "created_at": 100, "in_progress_at": 100, "expires_at": 100 + 86400,
            "metadata": None, "model": "m"}


def _lines(n: int) -> list[tuple[str, str, str | None]]:
    return [(f"c{i}", json.dumps({"model": "m", "messages": [{"role": "user", "content": str(i)}]}), None)
            for i in range(n)]


def test_files_are_scoped_by_tenant_and_paged(store: BatchStore) -> None:
    ids = [store.put_file("t1", "batch", f"f{i}.jsonl", b"x" * i, 100 + i).id for i in range(5)]
    other = store.put_file("t2", "batch", "o.jsonl", b"secret", 100)
    FileObject.model_validate(other.object())  # OpenAI's shape
    assert store.get_file("t1", other.id) is None and store.file_content("t1", other.id) is None
    assert not store.delete_file("t1", other.id) and store.file_content("t2", other.id) == b"secret"
    page, more = store.list_files("t1", None, Page(None, 2))
    assert [f.id for f in page] == ids[::-1][:2] and more
    page, more = store.list_files("t1", None, Page(page[-1].id, 10))
    assert [f.id for f in page] == ids[::-1][2:] and not more
    oldest, _ = store.list_files("t1", "batch", Page(None, 1, newest_first=False))
    assert oldest[0].id == ids[0]
    assert store.list_files("t1", "batch_output", Page(None, 10)) == ([], False)


def test_batches_carry_request_counts_and_are_scoped(store: BatchStore) -> None:
    refused = response_line("c9", "", 400, {"error": {"message": "bad"}})
    store.create_batch("t1", "key1", _batch("batch_a"), [*_lines(3), ("c9", "{}", refused)])
    got = store.get_batch("t1", "batch_a")
    assert got is not None
    Batch.model_validate(got)
    assert got["request_counts"] == {"total": 4, "completed": 0, "failed": 1}
    assert store.get_batch("t2", "batch_a") is None
    assert store.list_batches("t2", Page(None, 10)) == ([], False)
    assert store.batch_owner_key("batch_a") == ("t1", "key1")


def test_custom_ids_are_unique_per_batch(store: BatchStore) -> None:
    import sqlite3
    with pytest.raises(sqlite3.IntegrityError):
        store.create_batch("t1", "k", _batch("batch_dup"), [*_lines(2), *_lines(1)])
    assert store.get_batch("t1", "batch_dup") is None  # the whole batch rolled back


def test_one_owner_at_a_time_and_takeover_after_expiry(store: BatchStore) -> None:
    store.create_batch("t1", "k", _batch("batch_a"), _lines(2))
    first = store.claim("batch_a", "gw-a", now=1000.0, ttl=TTL)
    assert first is not None and first.epoch == 1
    assert store.claim("batch_a", "gw-b", now=1003.0, ttl=TTL) is None          # live lease: not yours
    assert store.runnable_batches("gw-b", 1003.0) == []
    renewed = store.renew(first, now=1004.0, ttl=TTL)
    assert renewed is not None and renewed.epoch == 1
    assert store.claim("batch_a", "gw-b", now=1009.0, ttl=TTL) is None          # renewed: until 1010
    assert store.runnable_batches("gw-b", 1010.5) == ["batch_a"]
    second = store.claim("batch_a", "gw-b", now=1010.5, ttl=TTL)                 # expired: taken over
    assert second is not None and second.epoch == 2
    assert store.renew(first, now=1011.0, ttl=TTL) is None                       # the old owner learns it
    again = store.claim("batch_a", "gw-b", now=1012.0, ttl=TTL)                  # our own: same epoch
    assert again is not None and again.epoch == 2


def test_a_stale_owners_writes_are_fenced(store: BatchStore) -> None:
    store.create_batch("t1", "k", _batch("batch_a"), _lines(3))
    old = store.claim("batch_a", "gw-a", 1000.0, TTL)
    assert old is not None and store.mark_running(old, 1, 1, "batch_a-1-1")
    new = store.claim("batch_a", "gw-b", 1000.0 + TTL + 1, TTL)
    assert new is not None
    # The old owner's line ends late: refused; it may not start lines either.
    assert not store.record_result(old, 1, response_line("c0", "r", 200, {}), True, 5)
    assert not store.mark_running(old, 2, 1, "batch_a-2-1")
    open_lines = store.open_lines("batch_a", 0, 10)
    assert [(ln.line, ln.state, ln.epoch, ln.request_id) for ln in open_lines] == [
        (1, "running", 1, "batch_a-1-1"), (2, "pending", 0, ""), (3, "pending", 0, "")]
    # The new owner records it once; a second write of the same line is refused.
    assert store.record_result(new, 1, response_line("c0", "r", 200, {}), True, 5)
    assert not store.record_result(new, 1, response_line("c0", "r2", 200, {}), True, 5)
    assert store.finish(old, "t1", {"status": "completed"}, [], 2000) is None
    assert store.update_batch(None, "batch_a", ("in_progress",), {"status": "finalizing"}, old) is None


def test_finish_stores_one_output_line_per_custom_id(store: BatchStore) -> None:
    store.create_batch("t1", "k", _batch("batch_a"), _lines(3))
    lease = store.claim("batch_a", "gw-a", 1000.0, TTL)
    assert lease is not None
    store.record_result(lease, 1, response_line("c0", "r0", 200, {"ok": 1}), True, 3)
    store.record_result(lease, 2, response_line("c1", "r1", 429, {"error": {}}), False, 0)
    files = files_of(store.outputs("batch_a"), "cancelled")
    done = store.finish(lease, "t1", {"status": "cancelled", "cancelled_at": 2000}, files, 2000)
    assert done is not None and done["status"] == "cancelled"
    out = store.file_content("t1", done["output_file_id"]) or b""
    err = store.file_content("t1", done["error_file_id"]) or b""
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["c0"]
    errors = [json.loads(x) for x in err.splitlines()]
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"], e["error"] and e["error"]["code"])
            for e in errors] == [("c1", 429, None), ("c2", None, "batch_cancelled")]
    assert store.get_file("t2", done["output_file_id"]) is None
    assert store.runnable_batches("gw-b", 99999.0) == []
    assert store.status_counts() == {"cancelled": 1}
