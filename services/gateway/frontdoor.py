"""What every request goes through before admission, in one order for every
transport: key -> model exists -> key may use it -> tokenize + context
check -> token buckets. The result is a `Job` plus the rate-limit grant to
settle when the request ends.

The front door's parts (keys, tokenizers, limiter, cache) are its own: the
transports ask it (`authenticate`, `tokenizer_for`, `listed_models`,
`model_tool_parser`) and the request pipeline (pipeline.py) admits and
settles through it, rather than reaching into them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.config import MeshConfig
from services.common.openai_api.requests import GenerationInput
from services.common.tracing import NO_SPAN, NO_TRACING, Span, Tracing
from services.gateway import request_trace
from services.gateway.jobs import Job, build_job
from services.gateway.keys import KeyStore, Principal, effective_priority
from services.gateway.limits import Grant, RateLimiter
from services.gateway.response_cache import ResponseCache, disabled_cache
from services.gateway.served_models import ServedModels
from services.gateway.tokenization import ModelTokenizer, TokenizerRegistry

__all__ = ["Admitted", "Frontdoor"]

log = logging.getLogger(__name__)


@dataclass
class Admitted:
    job: Job
    principal: Principal
    grant: Grant


class Frontdoor:
    def __init__(
        self, config: MeshConfig, keys: KeyStore, limiter: RateLimiter, tokenizers: TokenizerRegistry, clock: Clock,
        tracing: Tracing = NO_TRACING, cache: ResponseCache | None = None,
    ) -> None:
        self._config = config
        # The gateway's tracer: both transports start each request's span with it.
        self.tracing = tracing
        self.keys = keys
        self.limiter = limiter
        self.tokenizers = tokenizers
        self._clock = clock  # stamps each job's arrival
        # The response cache both transports consult after admission
        # (services/gateway/response_cache/); by default one that is off.
        self.cache = cache or disabled_cache()

    def authenticate(self, raw_key: str | None) -> Principal:
        return self.keys.authenticate(raw_key)

    @property
    def model_names(self) -> list[str]:
        """The models this gateway is configured for."""
        return self.tokenizers.names

    def tokenizer_for(self, principal: Principal, model: str) -> ModelTokenizer:
        """The model's tokenizer: a 404 for a model not configured, then a
        403 for one the key may not use."""
        tokenizer = self.tokenizers.get(model)
        self.keys.check_model(principal, model)
        return tokenizer

    def model_tool_parser(self, model: str) -> str:
        """The model's own tool-call format (`models[].tool_parser`)."""
        return self.tokenizers.get(model).tool_parser

    async def listed_models(self, principal: Principal, served: ServedModels) -> list[tuple[str, int, int]]:
        """(model, context length, engines) for each model served now that
        the key may use (GET /v1/models, ListModels)."""
        return await served.listed(self.tokenizers.names, lambda n: self.keys.allows(principal, n),
                                   lambda n: self.tokenizers.get(n).max_model_len)

    async def admit(
        self, request: GenerationInput, principal: Principal, priority: int, request_id: str,
        trace: Span = NO_SPAN,
    ) -> Admitted:
        """The request's job, its rate-limit grant taken; `trace` (its
        `gateway.request` span) goes with the job to the scheduler and engines."""
        tokenizer = self.tokenizers.get(request.model)
        self.keys.check_model(principal, request.model)
        job = await build_job(
            request, tokenizer, principal, effective_priority(priority, principal), request_id, self._config,
            self._clock,
        )
        grant = self.limiter.admit(principal, len(job.prompt_ids) + job.max_tokens * job.n)
        request_trace.admitted(trace, job)
        if self._config.gateway.log_prompts:
            log.info("request %s prompt: %r", request_id, request.messages or request.prompt_text or request.prompt_ids)
        # The request's line: its id (x-request-id) and, traced, its trace id.
        log.info(
            "request %s tenant=%s model=%s priority=%d prompt_tokens=%d max_tokens=%d%s",
            request_id, principal.tenant, request.model, job.priority, len(job.prompt_ids), job.max_tokens,
            f" trace={trace.trace_id}" if trace.trace_id else "",
        )
        return Admitted(job, principal, grant)

    def settle(self, admitted: Admitted, completion_tokens: int) -> None:
        self.limiter.settle(admitted.grant, len(admitted.job.prompt_ids) + completion_tokens)
