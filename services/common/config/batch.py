"""The Batch API (OpenAI's Files + Batches), under top-level `batch` in the
YAML: the batch service (services/batch/, `kvmesh batch`; README "Batch
API"), and what gateways honour from it (`internal_key_sha256`). Bounds are
checked at load by `validation.py`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchConfig"]


@dataclass
class BatchConfig:
    """Where the batch service listens and keeps its batches, how it reaches
    the gateways, how large an input may be, and how hard it drives them."""

    # `kvmesh up` runs one batch service (Envoy routes /v1/files and
    # /v1/batches to it). False: none runs, and those routes answer 503.
    enabled: bool = True
    # Bind address of both ports (0.0.0.0 or :: in a pod).
    host: str = "127.0.0.1"
    # The Files + Batches HTTP API (and GET /health). 0 .. 65535; 0 = any free.
    port: int = 8090
    # Plain HTTP: /metrics, /health/{started,ready,live}, loopback POST
    # /drain. 0 = off. 9190: clear of the gateways' 9102+r and engines' 9200+i.
    metrics_port: int = 9190
    # Where lines are sent (POST /v1/chat/completions, /v1/completions): a
    # gateway or Envoy, http(s)://host:port. Empty = the first gateway of
    # this config (http://<gateway.host>:<gateway.http_port>).
    gateway_url: str = ""
    # The SQLite file only the batch service writes (files, batches, their
    # lines and results, the ownership leases). Empty = <run_dir>/batch.sqlite3.
    # On Kubernetes a path on its PersistentVolumeClaim.
    database: str = ""
    # SHA-256 (`kvmesh key hash KEY`, 64 hex digits) of the internal
    # credential the batch service sends with each line. Gateways accept a
    # line's batch headers (creator's key id, batch deadline, resume) only
    # with that credential: batch lines bypass tenant queue caps, so an
    # ordinary client must not set them. Empty = the digest of
    # `internal_key_file`'s content; both empty = gateways refuse batch lines
    # (`kvmesh up` makes one for its run).
    internal_key_sha256: str = ""
    # A file holding the raw internal credential (on Kubernetes the Secret
    # kvmesh-batch-key, mounted in the batch pod and every gateway pod); the
    # env var KVMESH_BATCH_INTERNAL_KEY wins over it in the batch service.
    # With `internal_key_sha256` empty, gateways take the credential's
    # digest from this file (services/common/batch_credential.py), so no
    # per-install hash has to be in a config shared through git.
    internal_key_file: str = ""
    # SIGTERM / POST /drain: no new lines, those in flight get this long,
    # seconds. > 0. A line still running then stays resumable (the gateways
    # keep it `resume.grace_seconds`), so the drain need not be long.
    drain_seconds: float = 5.0
    # Largest upload to POST /v1/files, in bytes; larger -> 413. Within
    # 1 KiB .. 1 GiB. 64 MiB: ~50,000 chat requests of ~1 KiB (OpenAI allows
    # 200 MB; the file is held in memory once while it is validated).
    max_file_bytes: int = 64 * 1024 * 1024
    # Most requests (lines) in one batch. >= 1. 50,000 as OpenAI.
    max_lines: int = 50_000
    # Most lines the batch service runs at once across its batches. >= 1.
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
    # Ownership lease of a batch, seconds: a batch process that stops
    # renewing it (dead, restarted) is taken over this long after its last
    # renewal. > 0. 6 s: well inside `resume.grace_seconds` (15 s), so the
    # new owner can still resume the lines the dead one had in flight.
    lease_seconds: float = 6.0
    # How often the batch service renews its leases and looks for batches to run, and
    # for cancellation of those it owns, seconds. > 0 and < lease_seconds / 2.
    poll_seconds: float = 1.0
    # Each line sent carries an admit-by time, its owner's lease expiry less
    # this, and a gateway admits it only before then (services/batch/
    # ownership.py): a line sent by an owner that was since taken over is
    # refused, not run twice. Must exceed how far the clocks of the batch
    # processes and the gateways may differ (NTP keeps them within ms) plus
    # a gateway's time from its check to the scheduler's Admit (ms). >= 0
    # and < lease_seconds - poll_seconds (a lease about to be renewed still
    # leaves time to send).
    admit_margin_seconds: float = 0.5
    # The one completion window accepted, as OpenAI ("24h"), in seconds: a
    # batch not finished by then expires (the lines done are kept). > 0.
    completion_window_seconds: float = 86400.0
