"""The Batch API's state in SQLite: uploaded files, batches, each batch's
lines (requests) with their results, and the ownership leases
(ownership.py). One database file (`batch.database`), written by the
batch service alone, so a restart of any service loses nothing.

Concurrency: the process has ONE connection, used only from the store's
one worker thread (`Database.run`), so blocking SQLite calls never run on
the event loop and need no lock of ours. Across processes (a restart's
overlap, tests reading the file) SQLite's own
locking serializes writers: WAL mode (readers never block the writer),
`BEGIN IMMEDIATE` for read-then-write transactions, every transaction a
few statements long, a busy timeout for the rare wait.

Writes of an owner (a line started, a result, the final status) carry the
ownership FENCE: an owner taken over cannot write any more. Everything is
scoped by tenant: another tenant's id reads as nonexistent.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from services.batch import ownership
from services.batch.ownership import FENCE, Lease
from services.batch.records import ACTIVE, FileRecord, LineRecord, Page, new_id

__all__ = ["BatchStore", "Database"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL, purpose TEXT NOT NULL,
  filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
CREATE TABLE IF NOT EXISTS batches (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL, key_id TEXT NOT NULL,
  status TEXT NOT NULL, object TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS leases (
  batch_id TEXT PRIMARY KEY, owner TEXT NOT NULL, epoch INTEGER NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
  batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
  state TEXT NOT NULL, attempt INTEGER NOT NULL DEFAULT 0, request_id TEXT NOT NULL DEFAULT '',
  epoch INTEGER NOT NULL DEFAULT 0, output TEXT, ok INTEGER NOT NULL DEFAULT 0,
  tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line));
CREATE UNIQUE INDEX IF NOT EXISTS lines_by_custom_id ON lines (batch_id, custom_id);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, line);
"""

_LINE_COLUMNS = "batch_id, line, custom_id, body, state, attempt, request_id, epoch"
_FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at"


def _connect(path: str) -> sqlite3.Connection:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Autocommit (isolation_level None): one statement is one transaction;
    # longer ones say BEGIN IMMEDIATE themselves.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
    conn.execute("PRAGMA busy_timeout=10000")
    conn.executescript(_SCHEMA)
    return conn


class BatchStore:
    """Synchronous operations on the one connection; call them through
    `Database.run` (its worker thread), or directly in tests."""

    def __init__(self, path: str) -> None:
        self.conn = _connect(path)

    def close(self) -> None:
        self.conn.close()

    def _transaction(self, fn: Callable[[], T]) -> T:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            out = fn()
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        return out

    # ------------------------------------------------------------ files

    def put_file(self, tenant: str, purpose: str, filename: str, content: bytes, now: int) -> FileRecord:
        record = FileRecord(new_id("file-"), tenant, purpose, filename, len(content), now)
        self.conn.execute(f"INSERT INTO files ({_FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
                          (record.id, tenant, purpose, filename, len(content), now, content))
        return record

    def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        row = self.conn.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ? AND tenant = ?",
                                (file_id, tenant)).fetchone()
        return FileRecord(*row) if row else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        row = self.conn.execute("SELECT content FROM files WHERE id = ? AND tenant = ?",
                                (file_id, tenant)).fetchone()
        return bytes(row[0]) if row else None

    def list_files(self, tenant: str, purpose: str | None, page: Page) -> tuple[list[FileRecord], bool]:
        return self._page("files", _FILE_COLUMNS, tenant, page, ("purpose", purpose) if purpose else None, FileRecord)

    def delete_file(self, tenant: str, file_id: str) -> bool:
        return self.conn.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount == 1

    def _page(self, table: str, columns: str, tenant: str, page: Page, where: tuple[str, str] | None,
              make: Callable[..., T]) -> tuple[list[T], bool]:
        """One page of a tenant's rows in creation order, after the cursor
        id `after` (exclusive); and whether there are more."""
        after, limit, newest_first = page.after, page.limit, page.newest_first
        sql, params = f"SELECT {columns} FROM {table} WHERE tenant = ?", [tenant]
        if where:
            sql += f" AND {where[0]} = ?"
            params.append(where[1])
        if after:
            sql += f" AND seq {'<' if newest_first else '>'} (SELECT seq FROM {table} WHERE id = ? AND tenant = ?)"
            params += [after, tenant]
        sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        rows = self.conn.execute(sql, (*params, limit + 1)).fetchall()
        return [make(*r) for r in rows[:limit]], len(rows) > limit

    # ------------------------------------------------------------ batches

    def create_batch(self, tenant: str, key_id: str, batch: dict[str, Any],
                     lines: list[tuple[str, str, str | None]]) -> None:
        """The batch and its lines, in one transaction: (custom_id, body,
        output) per line; a line with an output (refused at validation) is
        done already."""
        def write() -> None:
            self.conn.execute("INSERT INTO batches (id, tenant, key_id, status, object) VALUES (?, ?, ?, ?, ?)",
                              (batch["id"], tenant, key_id, batch["status"], json.dumps(batch)))
            self.conn.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, body, state, output, ok) VALUES (?, ?, ?, ?, ?, ?, 0)",
                [(batch["id"], i, cid, body, "pending" if out is None else "done", out)
                 for i, (cid, body, out) in enumerate(lines, 1)])
        self._transaction(write)

    def batch_owner_key(self, batch_id: str) -> tuple[str, str] | None:
        """(tenant, key_id) of the batch's creator: whose key its lines run under."""
        row = self.conn.execute("SELECT tenant, key_id FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return (row[0], row[1]) if row else None

    def get_batch(self, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        """The Batch object with its request counts; `tenant` None: any (the runner)."""
        sql, params = "SELECT object FROM batches WHERE id = ?", [batch_id]
        if tenant is not None:
            sql += " AND tenant = ?"
            params.append(tenant)
        row = self.conn.execute(sql, params).fetchone()
        return self._with_counts(json.loads(row[0])) if row else None

    def list_batches(self, tenant: str, page: Page) -> tuple[list[dict[str, Any]], bool]:
        rows, more = self._page("batches", "object", tenant, page, None, json.loads)
        return [self._with_counts(b) for b in rows], more

    def _with_counts(self, batch: dict[str, Any]) -> dict[str, Any]:
        total, completed, failed = self.conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(state = 'done' AND ok = 1), 0), COALESCE(SUM(state = 'done' AND ok = 0), 0) "
            "FROM lines WHERE batch_id = ?", (batch["id"],)).fetchone()
        batch["request_counts"] = {"total": total, "completed": completed, "failed": failed}
        return batch

    def update_batch(self, tenant: str | None, batch_id: str, from_statuses: tuple[str, ...],
                     changes: dict[str, Any], lease: Lease | None = None) -> dict[str, Any] | None:
        """Apply `changes` to the Batch object (its `status` too) if its status
        is one of `from_statuses` (and, with `lease`, if the lease is still
        ours): the updated object, or None."""
        def write() -> dict[str, Any] | None:
            sql, params = "SELECT object FROM batches WHERE id = ?", [batch_id]
            if tenant is not None:
                sql += " AND tenant = ?"
                params.append(tenant)
            row = self.conn.execute(sql, params).fetchone()
            if row is None:
                return None
            batch = json.loads(row[0])
            if batch["status"] not in from_statuses:
                return None
            if lease is not None and not self.conn.execute(f"SELECT {FENCE}", lease.fence).fetchone()[0]:
                return None
            batch.update(changes)
            self.conn.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                              (batch["status"], json.dumps(batch), batch_id))
            return batch
        return self._transaction(write)

    def runnable_batches(self, owner: str, now: float) -> list[str]:
        """Active batches with no live lease of another owner, oldest first."""
        rows = self.conn.execute(
            "SELECT b.id FROM batches b LEFT JOIN leases l ON l.batch_id = b.id "
            f"WHERE b.status IN ({','.join('?' * len(ACTIVE))}) "
            "AND (l.batch_id IS NULL OR l.owner = ? OR l.expires_at <= ?) ORDER BY b.seq",
            (*ACTIVE, owner, now)).fetchall()
        return [r[0] for r in rows]

    def status_counts(self) -> dict[str, int]:
        return dict(self.conn.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())

    # ------------------------------------------------------------ leases

    def claim(self, batch_id: str, owner: str, now: float, ttl: float) -> Lease | None:
        return ownership.claim(self.conn, batch_id, owner, now, ttl)

    def renew(self, lease: Lease, now: float, ttl: float) -> Lease | None:
        return ownership.renew(self.conn, lease, now, ttl)

    def release(self, lease: Lease, not_before: float = 0.0) -> None:
        ownership.release(self.conn, lease, not_before)

    # ------------------------------------------------------------ lines

    def open_lines(self, batch_id: str, after_line: int, limit: int) -> list[LineRecord]:
        """Lines not done yet, in order, after `after_line`."""
        rows = self.conn.execute(
            f"SELECT {_LINE_COLUMNS} FROM lines WHERE batch_id = ? AND state != 'done' AND line > ? "
            "ORDER BY line LIMIT ?", (batch_id, after_line, limit)).fetchall()
        return [LineRecord(*r) for r in rows]

    def mark_running(self, lease: Lease, line: int, attempt: int, request_id: str) -> bool:
        """Line `line` is admitted now as `request_id` (fenced)."""
        return self.claim_line(lease, line, attempt, request_id) is not None

    def claim_line(self, lease: Lease, line: int, attempt: int, request_id: str) -> float | None:
        """Claim line `line` for one send as `request_id` under the lease
        (fenced, resumes too): the lease's expiry as the database has it, or
        None when the lease is no longer ours (then nothing may be sent).
        One transaction: the expiry read is the one the claim was made under
        (ownership.py: a gateway admits the send only before it)."""
        def write() -> float | None:
            cur = self.conn.execute(
                f"UPDATE lines SET state = 'running', attempt = ?, request_id = ?, epoch = ? "
                f"WHERE batch_id = ? AND line = ? AND state != 'done' AND {FENCE}",
                (attempt, request_id, lease.epoch, lease.batch_id, line, *lease.fence))
            if cur.rowcount != 1:
                return None
            row = self.conn.execute("SELECT expires_at FROM leases WHERE batch_id = ? AND owner = ? AND epoch = ?",
                                    lease.fence).fetchone()
            return float(row[0]) if row else None
        return self._transaction(write)

    def record_result(self, lease: Lease, line: int, output: str, ok: bool, tokens: int) -> bool:
        """The line's output line, once (fenced; a line done stays done)."""
        cur = self.conn.execute(
            f"UPDATE lines SET state = 'done', output = ?, ok = ?, tokens = ? "
            f"WHERE batch_id = ? AND line = ? AND state != 'done' AND {FENCE}",
            (output, int(ok), tokens, lease.batch_id, line, *lease.fence))
        return cur.rowcount == 1

    def outputs(self, batch_id: str) -> list[tuple[str, str | None, bool]]:
        """(custom_id, output or None when not done, ok) of every line, in order."""
        rows = self.conn.execute("SELECT custom_id, output, ok FROM lines WHERE batch_id = ? ORDER BY line",
                                 (batch_id,)).fetchall()
        return [(r[0], r[1], bool(r[2])) for r in rows]

    def finish(self, lease: Lease, tenant: str, changes: dict[str, Any],
               files: list[tuple[str, bytes]], now: int) -> dict[str, Any] | None:
        """The batch's end, in one fenced transaction: its output and error
        files stored (`(field, content)`: the batch field that names each)
        and the final status set. None when the lease is no longer ours."""
        def write() -> dict[str, Any] | None:
            if not self.conn.execute(f"SELECT {FENCE}", lease.fence).fetchone()[0]:
                return None
            row = self.conn.execute("SELECT object FROM batches WHERE id = ?", (lease.batch_id,)).fetchone()
            batch = json.loads(row[0])
            for field, content in files:
                name = f"{lease.batch_id}_{field.removesuffix('_file_id')}.jsonl"
                batch[field] = self.put_file(tenant, "batch_output", name, content, now).id
            batch.update(changes)
            self.conn.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                              (batch["status"], json.dumps(batch), lease.batch_id))
            return batch
        return self._transaction(write)


class Database:
    """The store behind its one worker thread: `await db.run(fn, *args)`
    runs `fn(*args)` there, off the event loop, one call at a time."""

    def __init__(self, path: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-db")
        self.store = self._executor.submit(BatchStore, path).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.submit(self.store.close).result()
        self._executor.shutdown(wait=True)
