"""`SpareCall`: a pre-opened call is handed out once, only while alive."""

from __future__ import annotations

from services.gateway.spare_calls import SpareCall


class FakeCall:
    def __init__(self, n: int) -> None:
        self.n = n
        self.ended = False
        self.cancelled = False

    def done(self) -> bool:
        return self.ended or self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Opener:
    def __init__(self) -> None:
        self.opened: list[FakeCall] = []

    def __call__(self) -> FakeCall:
        call = FakeCall(len(self.opened))
        self.opened.append(call)
        return call


def test_take_without_spare_opens_a_fresh_call() -> None:
    opener = Opener()
    spare = SpareCall(opener)  # type: ignore[arg-type]  # a fake opener: only what SpareCall calls
    assert spare.take() is opener.opened[0]  # type: ignore[comparison-overlap]  # the fake calls the fake opener made
    assert spare.take() is opener.opened[1]  # type: ignore[comparison-overlap]  # the fake calls the fake opener made


def test_replenished_call_is_handed_out_once() -> None:
    opener = Opener()
    spare = SpareCall(opener)  # type: ignore[arg-type]  # a fake opener: only what SpareCall calls
    spare.replenish()
    spare.replenish()  # one spare at most: an alive spare is kept
    assert len(opener.opened) == 1
    assert spare.take() is opener.opened[0]  # type: ignore[comparison-overlap]  # the fake calls the fake opener made
    assert spare.take() is opener.opened[1]  # type: ignore[comparison-overlap]  # the fake calls the fake opener made; not the same call twice


def test_a_spare_the_server_ended_is_never_handed_out() -> None:
    opener = Opener()
    spare = SpareCall(opener)  # type: ignore[arg-type]  # a fake opener: only what SpareCall calls
    spare.replenish()
    opener.opened[0].ended = True  # e.g. the scheduler restarted
    call = spare.take()
    assert call is opener.opened[1] and opener.opened[0].cancelled  # type: ignore[comparison-overlap]  # the fake calls the fake opener made


def test_replenish_replaces_a_dead_spare_and_discard_cancels() -> None:
    opener = Opener()
    spare = SpareCall(opener)  # type: ignore[arg-type]  # a fake opener: only what SpareCall calls
    spare.replenish()
    opener.opened[0].ended = True
    spare.replenish()
    assert len(opener.opened) == 2
    spare.discard()
    assert opener.opened[1].cancelled
    assert spare.take() is opener.opened[2]  # type: ignore[comparison-overlap]  # the fake calls the fake opener made
