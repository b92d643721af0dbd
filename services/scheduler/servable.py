"""Why a request no engine can take is refused: the checks `EngineFleet.
check_servable` ends in, kept apart from the fleet's books (fleet.py)."""

from __future__ import annotations

from collections.abc import Iterable

from .engine_registry import EngineRecord
from .records import AdmissionError, AdmitOptions, RejectReason
from .reservations import blocks_needed

__all__ = ["check_fits", "cold_start_refusal"]


def check_fits(options: AdmitOptions, usable: Iterable[EngineRecord], decode_headroom_tokens: int) -> None:
    """Raise TOO_LARGE when the request fits on none of `usable`."""
    need_len = options.prompt_tokens + options.max_tokens
    for e in usable:
        fits_len = e.info.max_model_len <= 0 or need_len <= e.info.max_model_len
        cold = blocks_needed(options.prompt_tokens, options.max_tokens, 0, e.info.block_size, decode_headroom_tokens)
        if fits_len and cold <= e.blocks_total():
            return
    raise AdmissionError(
        RejectReason.TOO_LARGE,
        f"{options.prompt_tokens} prompt + {options.max_tokens} max tokens fit on no engine "
        f"serving {options.model!r}; shorten the prompt or lower max_tokens",
    )


def cold_start_refusal(model: str, wait_seconds: float, retry_min: float) -> AdmissionError:
    """A request for a model scaled from zero that no engine started in time for."""
    return AdmissionError(
        RejectReason.NO_ENGINE,
        f"no engine serves model {model!r} and none started within {wait_seconds:g} s of the request "
        "(scheduler.scaling.cold_start_wait_seconds); check the autoscaler and the model name",
        retry_min,
    )
