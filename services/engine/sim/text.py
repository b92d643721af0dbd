"""Deterministic "greedy decoding" for the simulator.

The next token is a pure function of ALL tokens before it: a 64-bit rolling
hash (splitmix64 finalizer chained token by token) picks one of the codec's
clean token ids, or EOS with probability `eos_probability`. So a stream
continued on another engine from prompt + generated tokens produces exactly the
same continuation, as greedy decoding of a real model would. A token's text is
the codec's text of that id alone.

Sampling: a request with a temperature above 0 mixes a salt into every pick
-- derived from its seed, so the same seed gives the same answer (and the same
continuation after a migration), else random per request. The temperature's
value, top_p and top_k do not shape the choice: the simulator models cost, not
a distribution. No temperature, or 0, is greedy (deterministic), unlike vLLM,
whose default is 1.0: tests and benchmarks need reproducible answers.

logit_bias: the sim honours only its extremes -- a token biased +100 is
forced (of several at the largest bias >= 100, the rolling state picks one),
a token biased -100 is never picked (the state is rolled on until another
comes up); other biases do not shape the choice, as temperature does not.

Stop strings are applied by `services.common.stop_text.StopText`, as vLLM
applies them.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from services.engine.backend import Sampling

__all__ = ["ROLLING_SEED", "TokenPicker", "biased", "roll", "sampling_salt"]

_MASK = (1 << 64) - 1
ROLLING_SEED = 0x5EED_0F_C0FFEE


def roll(state: int, token_id: int) -> int:
    """Fold one token into the rolling hash (order-sensitive, 64-bit)."""
    z = (state ^ (token_id + 0x9E3779B97F4A7C15)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def roll_all(token_ids: Iterable[int], state: int = ROLLING_SEED) -> int:
    for token_id in token_ids:
        state = roll(state, token_id)
    return state


class TokenPicker:
    """Maps a rolling-hash state to the next token id."""

    def __init__(self, clean_token_ids: list[int], eos_token_id: int, eos_probability: float) -> None:
        if not clean_token_ids:
            raise ValueError("the sim needs at least one clean token id")
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be in [0, 1], got {eos_probability}")
        self._ids = clean_token_ids
        self.clean_token_ids = clean_token_ids
        self._eos = eos_token_id
        # EOS when the top 24 bits fall under this threshold.
        self._eos_threshold = int(eos_probability * (1 << 24))

    def next_token(self, state: int) -> int:
        if (state >> 40) < self._eos_threshold:
            return self._eos
        return self._ids[(state >> 7) % len(self._ids)]


def sampling_salt(sampling: Sampling) -> int:
    """0 for greedy requests; else the per-request salt (see the module doc)."""
    if not sampling.temperature or sampling.temperature <= 0:
        return 0
    if sampling.seed is not None:
        return roll(ROLLING_SEED, sampling.seed & _MASK) or 1
    return secrets.randbits(64) or 1


def biased(picker: TokenPicker, state: int, bias: dict[int, float]) -> int:
    """The next token under `bias` (see the module doc): a pure function of
    the state, so a continuation after a migration is the same."""
    top = max(bias.values(), default=0.0)
    if top >= 100:
        forced = sorted(t for t, b in bias.items() if b >= top)
        return forced[state % len(forced)]
    token = picker.next_token(state)
    for _ in range(64):  # banned tokens are few among the clean ids: this ends at once
        if bias.get(token, 0.0) > -100:
            break
        state = roll(state, token)
        token = picker.next_token(state)
    return token
