"""The Batch API (OpenAI's Files + Batches), under top-level `batch` in the
YAML (services/gateway/batch/; README "Batch API"). Bounds are checked at
load by `validation.py`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchConfig"]


@dataclass
class BatchConfig:
    """Where batches live, how large an input may be, and how hard each
    gateway drives the batches it owns."""

    # Serve /v1/files and /v1/batches and run batches. False: those routes
    # answer 404 and this gateway owns no batch.
    enabled: bool = True
    # The SQLite file every gateway of the mesh shares (files, batches, their
    # lines and results, the ownership leases). Empty = <run_dir>/batch.sqlite3,
    # so all gateways of one `kvmesh up` share it. Gateways on other machines
    # need a path on a shared disk that supports SQLite's locking (not NFS).
    database: str = ""
    # Largest upload to POST /v1/files, in bytes; larger -> 413. Within
    # 1 KiB .. 1 GiB. 64 MiB: ~50,000 chat requests of ~1 KiB (OpenAI allows
    # 200 MB; the file is held in memory once while it is validated).
    max_file_bytes: int = 64 * 1024 * 1024
    # Most requests (lines) in one batch. >= 1. 50,000 as OpenAI.
    max_lines: int = 50_000
    # Most lines one gateway runs at once across the batches it owns. >= 1.
    # The runner starts at 4 and adapts: it doubles (slow start) until lines
    # first wait too long, then grows by a line per window while lines are placed at
    # once (or wait in the scheduler's queue no longer than they then run: a
    # small backlog that fills each freed slot at once), shrinks when they
    # wait longer, and halves on 429s / queue rejections: a batch fills idle
    # capacity, not the queue.
    max_in_flight: int = 32
    # Tries of one line that failed (engines lost, an internal error) before
    # it goes to the error file. >= 1. Refusals -- the key's rate limit, a
    # full queue, no engine -- are waited out (backing off) without using
    # tries, until the batch's completion window ends.
    max_attempts: int = 5
    # Ownership lease of a batch, seconds: a gateway that stops renewing it
    # (dead, or cut off from the database) is taken over this long after its
    # last renewal. > 0. 6 s: well inside `resume.grace_seconds` (15 s), so
    # the new owner can still resume the lines the dead one had in flight.
    lease_seconds: float = 6.0
    # How often a gateway renews its leases and looks for batches to run, and
    # for cancellation of those it owns, seconds. > 0 and < lease_seconds / 2.
    poll_seconds: float = 1.0
    # The one completion window accepted, as OpenAI ("24h"), in seconds: a
    # batch not finished by then expires (the lines done are kept). > 0.
    completion_window_seconds: float = 86400.0
