"""Per-key token buckets: requests per second and tokens per minute.

Ownership: a `RateLimiter` is touched only from the gateway's event loop
(no awaits inside its methods), so its buckets need no lock. The clock is
injected so tests drive refills on a `FakeClock`.

Tokens are charged at admission as prompt + max_tokens (the most the request
can use, as OpenAI does), and the unused part of max_tokens is given back when
the request finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.clock import Clock
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.keys import Principal

__all__ = ["Grant", "RateLimiter", "TokenBucket"]


class TokenBucket:
    """`rate` tokens per second, holding at most `capacity`."""

    def __init__(self, rate: float, capacity: float, clock: Clock) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError("a token bucket needs a positive rate and capacity")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._at = clock.monotonic()

    def _refill(self) -> None:
        now = self._clock.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    @property
    def remaining(self) -> float:
        self._refill()
        return self._tokens

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (inf if it never can be)."""
        self._refill()
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self._tokens) / self.rate)

    def reset_seconds(self) -> float:
        """Seconds until the bucket is full again."""
        self._refill()
        return (self.capacity - self._tokens) / self.rate

    def take(self, amount: float) -> bool:
        self._refill()
        if amount > self._tokens:
            return False
        self._tokens -= amount
        return True

    def give_back(self, amount: float) -> None:
        self._refill()
        self._tokens = min(self.capacity, self._tokens + amount)


@dataclass
class Grant:
    """What a request was charged; `settle` returns what it did not use."""

    key_id: str
    tokens_charged: int
    headers: dict[str, str]


@dataclass
class _KeyBuckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class RateLimiter:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyBuckets] = {}

    def _buckets(self, principal: Principal) -> _KeyBuckets:
        buckets = self._keys.get(principal.key_id)
        if buckets is None:
            rps, tpm = principal.requests_per_second, principal.tokens_per_minute
            buckets = _KeyBuckets(
                # One second of burst, at least one request.
                TokenBucket(rps, max(1.0, rps), self._clock) if rps > 0 else None,
                # One minute of burst: the unit the limit is stated in.
                TokenBucket(tpm / 60.0, tpm, self._clock) if tpm > 0 else None,
            )
            self._keys[principal.key_id] = buckets
        return buckets

    def admit(self, principal: Principal, tokens: int) -> Grant:
        """Charge one request and `tokens` tokens, or raise 429 with Retry-After."""
        b = self._buckets(principal)
        if b.requests is not None and not b.requests.take(1):
            wait = b.requests.wait_for(1)
            raise GatewayError(
                ErrorKind.RATE_LIMITED,
                f"rate limit reached: {principal.requests_per_second:g} requests/s for this key; retry in {wait:.2f}s",
                code="rate_limit_exceeded",
                retry_after=wait,
                headers=_headers(b),
            )
        if b.tokens is not None and not b.tokens.take(tokens):
            if b.requests is not None:
                b.requests.give_back(1)
            wait = b.tokens.wait_for(tokens)
            if math.isinf(wait):
                raise GatewayError(
                    ErrorKind.RATE_LIMITED,
                    f"this request needs {tokens} tokens (prompt + max_tokens) but the key allows "
                    f"{principal.tokens_per_minute:g} tokens/min; lower max_tokens or shorten the prompt",
                    code="rate_limit_exceeded",
                    retry_after=60.0,
                    headers=_headers(b),
                )
            raise GatewayError(
                ErrorKind.RATE_LIMITED,
                f"rate limit reached: {principal.tokens_per_minute:g} tokens/min for this key; retry in {wait:.2f}s",
                code="rate_limit_exceeded",
                retry_after=wait,
                headers=_headers(b),
            )
        return Grant(principal.key_id, tokens if b.tokens is not None else 0, _headers(b))

    def settle(self, grant: Grant, tokens_used: int) -> None:
        """Give back the tokens charged but not used."""
        buckets = self._keys.get(grant.key_id)
        if buckets is not None and buckets.tokens is not None and grant.tokens_charged > tokens_used:
            buckets.tokens.give_back(grant.tokens_charged - tokens_used)


def _headers(b: _KeyBuckets) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for whichever buckets the key has."""
    out: dict[str, str] = {}
    for name, bucket in (("requests", b.requests), ("tokens", b.tokens)):
        if bucket is None:
            continue
        out[f"x-ratelimit-limit-{name}"] = f"{bucket.capacity:g}"
        out[f"x-ratelimit-remaining-{name}"] = str(int(bucket.remaining))
        out[f"x-ratelimit-reset-{name}"] = f"{bucket.reset_seconds():.3f}s"
    return out
