"""The sim honours logit_bias at its extremes (sim/text.py): +100 forces,
-100 bans; a pure function of the state (same continuation after a move)."""

from __future__ import annotations

from services.engine.sim.text import TokenPicker, biased, roll


def test_force_and_ban() -> None:
    picker = TokenPicker(list(range(10, 20)), eos_token_id=2, eos_probability=0.0)
    states = [roll(1, i) for i in range(200)]
    assert {biased(picker, s, {42: 100.0}) for s in states} == {42}
    assert {biased(picker, s, {42: 100.0, 43: 100.0, 44: 50.0}) for s in states} == {42, 43}
    banned = {10: -100.0, 11: -100.0, 12: -100.0}
    picks = [biased(picker, s, banned) for s in states]
    assert not set(picks) & set(banned) and set(picks) <= set(range(13, 20))
    assert [biased(picker, s, banned) for s in states] == picks   # deterministic
    # Biases between the extremes do not shape the sim's choice.
    assert [biased(picker, s, {10: 5.0}) for s in states] == [picker.next_token(s) for s in states]
