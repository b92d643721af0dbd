"""The soak's mixed traffic, beside the chaos clients' streamed completions
(scripts/chaoslib/outcomes.py, which the soak runs for its streamed kinds):
non-streamed chat, tool calls and structured outputs, cached repeats, and
Responses conversations chained with `previous_response_id`.

Every request is one of a few distinct deterministic ones (temperature 0;
the sim's text is a pure function of the tokens before it), answered once
before any fault (`baseline`), so an answer during the soak is checked
whole against that uninterrupted one: a signature of its text, tool calls
and finish reason (`signature`). Outcomes as in the chaos accounting:
completed (200, the expected signature), rejected (an HTTP status with an
OpenAI error body: a definite answer the client can act on), lost (anything
else: no answer, a wrong one, a status without an error body, or an answer
that says state was lost -- a stored response not found).

Non-streamed requests need no resume: Envoy retries one whose gateway died
before any byte of the answer (its `reset` retry), and a non-streamed answer
is one body written at the end. Streamed tool calls and streamed Responses
are not sent: neither can be resumed after a gateway SIGKILL (a tool-calling
stream is refused a resume, README "Tool calling"; /v1/responses has no
Last-Event-ID), so they would measure that known limit, not the mesh.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from jsonschema import Draft202012Validator

from scripts.chaoslib.outcomes import REQUEST_TIMEOUT_SECONDS, Tally, Target

__all__ = ["Answer", "Call", "PERSON", "WEATHER", "baseline_calls", "baseline_conversation", "call_worker",
           "check_shapes", "classify", "conversation_worker", "make_calls", "signature"]

PERSON: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "minLength": 2}, "age": {"type": "integer", "minimum": 18},
                   "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}}}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}},
                                "required": ["city"]}}}
TURNS = ("Tell me about meshes.", "And what about queues?", "Why do engines fail?", "How is a stream resumed?",
         "What does a scheduler own?", "Summarise our talk.")
# Error codes that say state the mesh promised to keep is gone.
_STATE_LOST = ("response_not_found", "resume_not_found")


@dataclass(frozen=True)
class Answer:
    """What a non-streamed client got: the status and, for a 200, the
    answer's signature (else the body or the exception)."""

    status: int
    signature: str = ""
    error: str = ""
    cache: str = ""          # X-Kvmesh-Cache: hit | miss | ...
    response_id: str = ""    # a Responses answer's id


@dataclass(frozen=True)
class Call:
    """One distinct non-streamed request."""

    path: str                # /v1/chat/completions | /v1/responses
    body_json: str
    priority: int
    api_key: str


def signature(path: str, body: dict[str, Any]) -> str:
    """What must match the uninterrupted answer: text, tool calls, finish."""
    if path == "/v1/responses":
        texts = [part.get("text", "") for item in body.get("output", ()) if item.get("type") == "message"
                 for part in item.get("content", ())]
        return json.dumps(["".join(texts), body.get("status")])
    choice = body["choices"][0]
    message = choice.get("message") or {}
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or ()]
    return json.dumps([message.get("content"), calls, choice.get("finish_reason")])


def classify(answer: Answer, expected: str) -> tuple[str, str]:
    """("ok" | "rejected" | "lost", reason)."""
    if answer.status == 200:
        if answer.signature == expected:
            return "ok", ""
        return "lost", "answer differs from the uninterrupted one"
    if answer.status == 0:
        return "lost", answer.error[:100] or "no answer"
    try:
        error = json.loads(answer.error)["error"]
        code, message = str(error.get("code") or "error"), str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "lost", f"http {answer.status} without an error body"
    if code in _STATE_LOST:
        return "lost", f"http {answer.status} {code}"
    return "rejected", f"http {answer.status} {code}: {message[:80]}"


async def post(session: aiohttp.ClientSession, target: Target, call: Call,
               body: dict[str, Any] | None = None) -> Answer:
    """Send one call (`body` overrides its body); never raises."""
    headers = {"Authorization": f"Bearer {call.api_key}", "X-Priority": str(call.priority)}
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
            async with session.post(f"{target.base_url}{call.path}", headers=headers,
                                    json=body if body is not None else json.loads(call.body_json)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    return Answer(resp.status, error=text[:2000])
                data = json.loads(text)
                return Answer(200, signature(call.path, data), cache=resp.headers.get("X-Kvmesh-Cache", ""),
                              response_id=str(data.get("id", "")))
    except TimeoutError:
        return Answer(0, error=f"no answer after {REQUEST_TIMEOUT_SECONDS:g} s")
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        return Answer(0, error=f"{type(exc).__name__}: {exc}")


def record(tally: Tally, answer: Answer, expected: str) -> str:
    kind, reason = classify(answer, expected)
    if kind == "ok":
        tally.completed += 1
        if answer.cache == "hit":
            tally.counters["cache hits"] += 1
    elif kind == "rejected":
        tally.rejected[reason] += 1
    else:
        tally.lost[reason] += 1
    return kind


def check_shapes(structured: list[str], tool_signatures: list[str]) -> None:
    """The uninterrupted answers are what was asked for: JSON valid against
    the schema, tool calls with valid arguments (else the soak compares
    against nonsense)."""
    person, weather = Draft202012Validator(PERSON), Draft202012Validator(WEATHER["function"]["parameters"])
    for text in structured:
        if list(person.iter_errors(json.loads(text))):
            raise SystemExit(f"soak: a structured baseline answer is not valid against its schema: {text[:200]}")
    for sig in tool_signatures:
        _, calls, finish = json.loads(sig)
        if finish != "tool_calls" or not calls or any(list(weather.iter_errors(json.loads(a))) for _, a in calls):
            raise SystemExit(f"soak: a tool-call baseline answer is not a valid call: {sig[:200]}")


def make_calls(rng: random.Random, model: str, api_key: str, cache_key: str) -> dict[str, list[Call]]:
    """The distinct non-streamed requests of each kind."""
    def chat(extra: dict[str, Any], priority: int, key: str, i: int, max_tokens: int) -> Call:
        body = {"model": model, "temperature": 0, "max_tokens": max_tokens, **extra,
                "messages": [{"role": "user", "content": f"soak question {i}: {rng.choice(['why', 'how'])} "
                                                         f"do {rng.choice(['meshes', 'queues', 'leases'])} work?"}]}
        return Call("/v1/chat/completions", json.dumps(body), priority, key)

    schema = {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}
    tools = {"tools": [WEATHER], "tool_choice": "required"}
    return {
        "chat": [chat({}, 1, api_key, i, rng.randrange(8, 64)) for i in range(8)],
        "tools": [chat(tools, 0, api_key, 100 + i, 64) for i in range(4)],
        "structured": [chat(schema, 2, api_key, 200 + i, 64) for i in range(4)],
        # Few distinct questions, asked again and again: after the first, hits.
        "cache": [chat({}, 1, cache_key, 300 + i, 24) for i in range(3)],
    }


async def baseline_calls(target: Target, calls: list[Call]) -> dict[Call, str]:
    """The uninterrupted answers, before any fault."""
    async with aiohttp.ClientSession() as session:
        answers = [await post(session, target, c) for c in calls]
    bad = [(c.body_json[:80], a.status, a.error[:200]) for c, a in zip(calls, answers, strict=True)
           if a.status != 200]
    if bad:
        raise SystemExit(f"soak: the baseline failed before any fault: {bad[:3]}")
    return {c: a.signature for c, a in zip(calls, answers, strict=True)}


async def call_worker(target: Target, calls: list[Call], expected: dict[Call, str], rng: random.Random,
                      until: float, tally: Tally) -> None:
    """One client sending these calls one after another until `until`."""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            call = rng.choice(calls)
            tally.sent += 1
            if record(tally, await post(session, target, call), expected[call]) == "rejected":
                await asyncio.sleep(0.5)   # a client backs off after a refusal
            await asyncio.sleep(rng.uniform(0.05, 0.3))


def _turn(target: Target, priority: int, turn: int, previous: str | None) -> tuple[Call, dict[str, Any]]:
    body: dict[str, Any] = {"model": target.model, "input": TURNS[turn], "max_output_tokens": 12,
                            "temperature": 0, "store": True}
    if previous is not None:
        body["previous_response_id"] = previous
    return Call("/v1/responses", "{}", priority, target.api_key), body


async def baseline_conversation(target: Target) -> list[str]:
    """Each turn's uninterrupted answer (it depends on every turn before)."""
    previous: str | None = None
    out = []
    async with aiohttp.ClientSession() as session:
        for turn in range(len(TURNS)):
            answer = await post(session, target, *_turn(target, 1, turn, previous))
            if answer.status != 200:
                raise SystemExit(f"soak: the baseline conversation failed at turn {turn}: {answer.error[:300]}")
            out.append(answer.signature)
            previous = answer.response_id
    return out


async def conversation_worker(target: Target, expected: list[str], priority: int, rng: random.Random,
                              until: float, tally: Tally) -> None:
    """Conversations of len(TURNS) turns, each continuing the last; a
    refused turn is asked again, a lost one starts a new conversation."""
    async with aiohttp.ClientSession() as session:
        turn, previous = 0, None
        while time.monotonic() < until:
            tally.sent += 1
            answer = await post(session, target, *_turn(target, priority, turn, previous))
            kind = record(tally, answer, expected[turn])
            if kind == "ok":
                turn, previous = turn + 1, answer.response_id
                if turn == len(TURNS):
                    turn, previous = 0, None
            elif kind == "rejected":
                await asyncio.sleep(0.5)
            else:
                turn, previous = 0, None
            await asyncio.sleep(rng.uniform(0.05, 0.3))
