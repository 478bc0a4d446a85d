"""A guard the trainer-integration tests share: a checkpoint must not gather the swapped state
into RAM."""

from __future__ import annotations

import pytest

from tierswap.optim import persist


@pytest.fixture
def no_gathering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail when ``state_dict()`` gathers state after a step (a checkpoint should snapshot).

    Before the first step the state is empty (Accelerate round-trips it at ``prepare()``).
    """
    gather = persist.state_dict

    def never_after_a_step(optimizer, *args):  # type: ignore[no-untyped-def]
        if optimizer.steps:
            raise AssertionError("a checkpoint gathered the optimizer state into RAM")
        return gather(optimizer, *args)

    monkeypatch.setattr(persist, "state_dict", never_after_a_step)
