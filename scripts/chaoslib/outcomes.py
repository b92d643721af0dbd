"""Load and outcome accounting shared by both chaos meshes (loopback and
`--netns`): clients stream `/v1/completions` through Envoy with the one
resuming client of the namespace tests (`tests/netns/client.py`: a broken or
stalled stream is sent again with `Last-Event-ID`), every answer is checked
against an uninterrupted answer to the same request, and each request ends
as completed, rejected (by reason) or lost (by reason)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from tests.netns.client import Stream, stream_completion

REQUEST_TIMEOUT_SECONDS = 180.0
MAX_RESUMES = 5


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    # X-Priority to send (None: the key's default class); a chat request
    # instead of a completion; more body fields as JSON text (hashable: a Job
    # keys its expected answer).
    priority: int | None = None
    chat: bool = False
    extra_json: str = ""


@dataclass(frozen=True)
class Target:
    """Where clients send: Envoy's public URL, an API key, the model."""

    base_url: str
    api_key: str
    model: str
    # A stream with no byte (not even a heartbeat) for this long is resumed; None: only broken ones.
    stall_seconds: float | None = None


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    # Completed streams that needed a Last-Event-ID resume / a plain re-send
    # (cut before any event id arrived).
    resumed: int = 0
    resent: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: collections.Counter[str] = field(default_factory=collections.Counter)
    actions: list[str] = field(default_factory=list)
    # Gateway counters (migrations, re-admissions) summed over every gateway life.
    counters: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    # Seconds from sending to the first text, of completed requests, by class
    # ("P0".."P2"; "default": no X-Priority), resumes and re-sends included.
    ttft: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))


def merged(a: Tally, b: Tally) -> Tally:
    """One tally of two runs of the same load (the halves of a paired run's
    run without faults)."""
    out = Tally(sent=a.sent + b.sent, completed=a.completed + b.completed, resumed=a.resumed + b.resumed,
                resent=a.resent + b.resent, rejected=a.rejected + b.rejected, lost=a.lost + b.lost,
                actions=a.actions + b.actions)
    for t in (a, b):
        for series, value in t.counters.items():
            out.counters[series] += value
        for label, values in t.ttft.items():
            out.ttft[label].extend(values)
    return out


def class_label(priority: int | None) -> str:
    return "default" if priority is None else f"P{priority}"


def make_jobs(rng: random.Random, distinct: int, max_tokens: int, mix: tuple[float, ...] = ()) -> list[Job]:
    """`distinct` requests; with `mix` (P0, P1, P2 weights) each is sent with
    an X-Priority drawn from it (a mixed-priority load), else with none."""
    jobs = [Job(f"chaos prompt {i}: {rng.choice(['tell', 'write', 'explain'])} a story about "
                f"{rng.choice(['meshes', 'engines', 'queues', 'tokens'])} number {rng.randrange(1000)}",
                rng.randrange(8, max_tokens + 1)) for i in range(distinct)]
    if not mix:
        return jobs
    return [dataclasses.replace(j, priority=rng.choices(range(len(mix)), weights=mix)[0]) for j in jobs]


async def _send(session: aiohttp.ClientSession, target: Target, job: Job) -> Stream:
    s = Stream(job.prompt, job.max_tokens, model=target.model, chat=job.chat,
               headers={} if job.priority is None else {"X-Priority": str(job.priority)},
               extra=json.loads(job.extra_json) if job.extra_json else {})
    return await stream_completion(session, target.base_url, s, stall_seconds=target.stall_seconds, resume=True,
                                   attempts=MAX_RESUMES + 1, timeout=REQUEST_TIMEOUT_SECONDS,
                                   api_key=target.api_key)


def outcome(s: Stream, expected: str) -> tuple[str, str]:
    """("ok" | "rejected" | "lost", reason) of one finished stream."""
    resumed = s.resumes > 0 or s.resent > 0
    if s.ok:
        if s.text == expected:
            return "ok", s.finish_reason or ""
        return "lost", "text differs from the uninterrupted answer" + (" after a resume" if resumed else "")
    if s.status not in (0, 200):
        try:
            error = json.loads(s.error or "")["error"]
            code, message = error.get("code") or "error", str(error.get("message", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            return "lost", f"http {s.status} without an error body"
        if s.text or s.last_event_id is not None:
            return "lost", f"resume answered http {s.status} {code}: {message[:80]}"
        return "rejected", f"http {s.status} {code}: {message[:90]}"
    if s.error_code is not None:
        return ("lost", f"error after text: {s.error_code}") if s.text else ("rejected", f"sse error {s.error_code}")
    if s.error is None:
        return "lost", f"[DONE] without a finish reason (finish={s.finish_reason})"
    if s.last_event_id is None and s.text:
        return "lost", f"cut after text with no event id to resume from ({s.error[:60]})"
    return "lost", s.error[:100]


def record(tally: Tally, s: Stream, expected: str, job: Job | None = None, sent_at: float | None = None) -> str:
    """Count `s` in `tally`; with `job` and `sent_at`, a completed request's
    first-text time under its class."""
    kind, reason = outcome(s, expected)
    if kind == "ok":
        if job is not None and sent_at is not None and s.first_text_at is not None:
            tally.ttft[class_label(job.priority)].append(s.first_text_at - sent_at)
        tally.completed += 1
        tally.resumed += bool(s.resumes)
        tally.resent += bool(s.resent)
    elif kind == "rejected":
        tally.rejected[reason] += 1
    else:
        tally.lost[reason] += 1
    return kind


async def baseline(target: Target, jobs: list[Job]) -> dict[Job, str]:
    """The uninterrupted answers, before any fault."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = await asyncio.gather(*(_send(session, target, j) for j in jobs))
    bad = [(j, s.error) for j, s in zip(jobs, answers, strict=True) if not s.ok or s.resumes or s.resent]
    if bad:
        raise SystemExit(f"chaos: the baseline run failed before any fault: {bad[:3]}")
    return {j: s.text for j, s in zip(jobs, answers, strict=True)}


async def load(target: Target, jobs: list[Job], expected: dict[Job, str], rng: random.Random, until: float,
               concurrency: int, tally: Tally) -> None:
    """`concurrency` clients, each sending one request after another until `until`."""
    async def worker(seed: int) -> None:
        local = random.Random(seed)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while time.monotonic() < until:
                job = local.choice(jobs)
                tally.sent += 1
                sent_at = time.monotonic()
                if record(tally, await _send(session, target, job), expected[job], job, sent_at) == "rejected":
                    await asyncio.sleep(0.2)  # a client backs off after a refusal
    await asyncio.gather(*(worker(rng.randrange(2**32)) for _ in range(concurrency)))


def report(tally: Tally, took: float, extra: Callable[[], list[str]] = list) -> int:
    """Print what clients saw; 1 if anything was lost."""
    lost = sum(tally.lost.values())
    print("chaos: faults:")
    for line in tally.actions:
        print(f"  {line}")
    print(f"chaos: {took:.1f}s of load: sent {tally.sent}, completed {tally.completed} "
          f"(resumed with Last-Event-ID {tally.resumed}, re-sent before any event {tally.resent}), "
          f"rejected {sum(tally.rejected.values())}, lost {lost}")
    for reason, n in tally.rejected.most_common():
        print(f"  rejected {n}: {reason}")
    for reason, n in tally.lost.most_common():
        print(f"  LOST {n}: {reason}")
    for series, value in sorted(tally.counters.items()):
        print(f"  gateway {series} = {value:.0f}")
    for line in extra():
        print(f"  {line}")
    return 1 if lost else 0
