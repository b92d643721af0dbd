"""What parsing an OpenAI request body costs the gateway, per body shape.

    .venv/bin/python scripts/bench_parse.py [--rounds 3000]

Times `parse_json_body` + the body's parser (`parse_chat_body`,
`parse_completion_body`, `parse_responses_body`) in process, on the bodies
agents and chat clients send: a short classification prompt, a 10-turn
conversation, four tools, a JSON schema. Prints p50 and p99 per body and the
JSON decode alone for scale. The first body with a schema pays jsonschema's
own check (milliseconds); the repeats show the memoised check
(`structured_outputs._known_valid_schema`), which is what a conversation's
later turns pay. Results: BENCHMARKS.md "Parsing a request body".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.openai_api.requests import (
    parse_chat_body,
    parse_completion_body,
    parse_json_body,
)
from services.common.openai_api.responses_input import parse_responses_body

_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name"]}}}

BODIES: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
    "chat, short": (parse_chat_body, {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "Classify the sentiment: great product, fast shipping."}]}),
    "chat, 10 turns": (parse_chat_body, {
        "model": "m", "max_tokens": 128, "temperature": 0.7, "top_p": 0.9, "stream": True,
        "stream_options": {"include_usage": True}, "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "You are helpful."},
                     *({"role": role, "content": "x" * 200} for role in ["user", "assistant"] * 5)]}),
    "chat, 4 tools": (parse_chat_body, {
        "model": "m", "tool_choice": "auto", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{**_TOOL, "function": {**_TOOL["function"], "name": f"tool_{i}"}} for i in range(4)]}),
    "chat, json_schema": (parse_chat_body, {
        "model": "m", "response_format": _SCHEMA, "messages": [{"role": "user", "content": "A city as JSON"}]}),
    "completion": (parse_completion_body, {"model": "m", "prompt": "Once upon a time", "max_tokens": 4}),
    "responses": (parse_responses_body, {"model": "m", "input": "Hello", "max_output_tokens": 16}),
}


def _timings(parse: Callable[[Any], Any], raw: bytes, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        parse(parse_json_body(raw))
        out.append(time.perf_counter() - start)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3000, help="parses per body (default 3000)")
    args = parser.parse_args()
    print(f"{'body':18s} {'bytes':>6s} {'first':>10s} {'p50':>9s} {'p99':>9s}")
    for name, (parse, body) in BODIES.items():
        raw = json.dumps(body).encode()
        first = _timings(parse, raw, 1)[0]
        times = _timings(parse, raw, args.rounds)
        print(f"{name:18s} {len(raw):6d} {first * 1e6:8.0f}us {statistics.median(times) * 1e6:7.1f}us "
              f"{times[int(0.99 * len(times))] * 1e6:7.1f}us")
    decode = _timings(lambda parsed: parsed, json.dumps(BODIES["chat, short"][1]).encode(), args.rounds)
    print(f"{'JSON decode alone':18s} {'':6s} {'':10s} {statistics.median(decode) * 1e6:7.1f}us")


if __name__ == "__main__":
    main()
