"""Who runs a batch: one ownership lease row per batch (owner, epoch,
expires_at) in the database, so that each batch has exactly ONE owner at
a time -- even while a restarted batch process overlaps its predecessor.

- `claim`: in one write transaction, take a batch whose lease is missing,
  expired, or already ours. Taking it from another owner (expired) bumps the
  epoch; renewing our own keeps it.
- `renew`: push our lease's expiry on, only while (owner, epoch) is still
  ours -- an owner that was taken over learns it here and stops.
- `FENCE`: the SQL condition every result write of an owner carries, so a
  stale owner's late write (it was taken over while its line still ran) is
  refused by the database, not by a check before the write.
- Sends are fenced too, in two halves, so a stale-but-alive owner (taken
  over while it still runs: a pod replacement's overlap, a partition, a
  stall past its lease) can never get a line admitted. Right before EVERY
  send of a line -- a new attempt or a resume -- the owner claims the line
  under (owner, epoch) and reads the lease's expiry in the same transaction
  (`BatchStore.claim_line`); no claim, no send. That alone leaves the time
  between the claim and the gateway's admission (a stall, a slow connect),
  so the send carries an admit-by time, the claimed expiry less
  `batch.admit_margin_seconds`, and the gateway refuses the line after it
  (services/gateway/batch_lines.py, 409 `batch_lease_expired`). A new owner
  takes over only once the expiry has passed, so every send of the old
  owner that a gateway admitted was admitted before the takeover, under a
  request id the database already shows as running: the new owner resumes
  it rather than running the line again. A clean `release` shortens the
  lease, so an owner that stops with a send cut off mid-way keeps it until
  that send's claimed expiry. This holds while the clocks of
  the batch processes and gateways agree to within the margin (NTP: a few
  ms).

Time is passed in (`now`, wall seconds): the functions are pure over the
connection, and tests drive them with a fake clock. Callers run them in the
store's one worker thread (store.py).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

__all__ = ["FENCE", "Lease", "claim", "release", "renew"]

# Appended to a write's WHERE clause, with params (batch_id, owner, epoch).
FENCE = "EXISTS (SELECT 1 FROM leases WHERE batch_id = ? AND owner = ? AND epoch = ?)"


@dataclass(frozen=True)
class Lease:
    batch_id: str
    owner: str
    epoch: int
    expires_at: float

    @property
    def fence(self) -> tuple[str, str, int]:
        """The parameters of `FENCE` for this lease."""
        return (self.batch_id, self.owner, self.epoch)


def claim(conn: sqlite3.Connection, batch_id: str, owner: str, now: float, ttl: float) -> Lease | None:
    """Our lease on `batch_id`, or None while another owner's is live."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT owner, epoch, expires_at FROM leases WHERE batch_id = ?", (batch_id,)).fetchone()
        if row is None:
            epoch = 1
            conn.execute("INSERT INTO leases (batch_id, owner, epoch, expires_at) VALUES (?, ?, ?, ?)",
                         (batch_id, owner, epoch, now + ttl))
        elif row[0] == owner:
            epoch = row[1]  # ours still: nobody else can have written since
            conn.execute("UPDATE leases SET expires_at = ? WHERE batch_id = ?", (now + ttl, batch_id))
        elif row[2] <= now:
            epoch = row[1] + 1  # taken over: the old owner's writes are fenced from now on
            conn.execute("UPDATE leases SET owner = ?, epoch = ?, expires_at = ? WHERE batch_id = ?",
                         (owner, epoch, now + ttl, batch_id))
        else:
            conn.execute("COMMIT")
            return None
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return Lease(batch_id, owner, epoch, now + ttl)


def renew(conn: sqlite3.Connection, lease: Lease, now: float, ttl: float) -> Lease | None:
    """The lease pushed on, or None when it is no longer ours."""
    cur = conn.execute("UPDATE leases SET expires_at = ? WHERE batch_id = ? AND owner = ? AND epoch = ?",
                       (now + ttl, *lease.fence))
    return Lease(lease.batch_id, lease.owner, lease.epoch, now + ttl) if cur.rowcount == 1 else None


def release(conn: sqlite3.Connection, lease: Lease, not_before: float = 0.0) -> None:
    """Give the batch up (a clean stop): another process takes it at its
    next poll instead of after the expiry -- but not before `not_before`,
    the expiry a send cut off mid-way was claimed under (it may still be
    admitted until then; batch_run.py `sends_cut_until`)."""
    conn.execute("UPDATE leases SET expires_at = MIN(expires_at, ?) WHERE batch_id = ? AND owner = ? AND epoch = ?",
                 (not_before, *lease.fence))
