"""offload() and swapped(): the two adapters around SwapOptimizer."""

from __future__ import annotations

import pytest
import torch

from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batches,
    groups,
    make_models,
    train_step,
)
from tierswap.optim import SwapOptimizer, offload, swapped


def test_offload_keeps_class_groups_and_state() -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.RMSprop(groups(plain_model, lr=2e-3), lr=1e-2, momentum=0.5)
    existing = torch.optim.RMSprop(groups(swap_model, lr=2e-3), lr=1e-2, momentum=0.5)
    data = batches(5)
    for x in data[:2]:
        train_step(plain_model, plain, x)
        train_step(swap_model, existing, x)
    swap = offload(existing, host_budget="1MiB")
    with swap:
        assert isinstance(swap, SwapOptimizer)
        assert type(swap._inner) is torch.optim.RMSprop
        assert not existing.state  # moved, not copied
        assert swap.param_groups[1]["lr"] == 2e-3
        for x in data[2:]:
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())


def test_offload_rejects_non_optimizers() -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        offload(object())


def test_swapped_class_is_a_constructible_optimizer_class() -> None:
    plain_model, swap_model = make_models()
    cls = swapped(torch.optim.Adamax)
    assert issubclass(cls, torch.optim.Optimizer)
    assert cls.__name__ == "SwappedAdamax"
    plain = torch.optim.Adamax(plain_model.parameters(), lr=1e-2)
    with cls(swap_model.parameters(), lr=1e-2, host_budget="64KiB") as swap:
        for x in batches(3):
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        assert_same_params(plain_model, swap_model)


def test_lr_scheduler_accepts_it() -> None:
    _, model = make_models()
    with swapped(torch.optim.SGD)(model.parameters(), lr=1.0) as swap:
        sched = torch.optim.lr_scheduler.LambdaLR(swap, lambda epoch: 0.5**epoch)
        train_step(model, swap, batches(1)[0])
        sched.step()
        assert swap.param_groups[0]["lr"] == 0.5
