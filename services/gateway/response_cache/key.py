"""The cache key: SHA-256 over a canonical encoding of everything that
decides an answer.

    scope        "tenant:<tenant>", or "shared" for keys configured to share
    model        its name AND revision (revision.py): a new revision never
                 reads an old revision's entry
    route        chat | completion (the output's shape)
    prompt       the prompt's token ids, after the chat template (so two
                 spellings of one prompt share an entry; a template change
                 does not)
    sampling     every sampling option (temperature, seed, top_p/k, min_p,
                 penalties, stop, stop_token_ids, logprobs, min_tokens,
                 ignore_eos, logit_bias) and the effective max_tokens
    output       n, echo, structured output, tools, tool_choice,
                 parallel_tool_calls

The encoding is JSON with sorted keys and no whitespace, versioned (`v`):
a change of encoding changes every key rather than misreading old entries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from services.common.openai_api.requests import GenerationInput
from services.gateway.jobs import Job

__all__ = ["KEY_VERSION", "cache_key", "cache_scope"]

KEY_VERSION = 1


def cache_scope(tenant: str, shared: bool) -> str:
    """Whose entries a request may read and write."""
    return "shared" if shared else f"tenant:{tenant}"


def cache_key(scope: str, revision: str, job: Job, request: GenerationInput) -> str:
    """64 hex digits; equal exactly when every input above is equal."""
    sampling = dataclasses.asdict(job.sampling)
    # JSON object keys must be strings; a sorted pair list keeps ids exact.
    sampling["logit_bias"] = sorted(job.sampling.logit_bias.items())
    document: dict[str, Any] = {
        "v": KEY_VERSION,
        "scope": scope,
        "model": job.model,
        "revision": revision,
        "route": job.route,
        "prompt": job.prompt_ids,
        "sampling": sampling,
        "max_tokens": job.max_tokens,
        "n": job.n,
        "echo": job.echo_text,
        "structured": dataclasses.asdict(job.structured) if job.structured is not None else None,
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    encoded = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(encoded.encode()).hexdigest()
