"""Partitioning, state-size probing and the write-behind choice."""

from __future__ import annotations

import itertools

import pytest
import torch

from tierswap.errors import ConfigError
from tierswap.optim.plan._partition import Slot, check_budget, master_dtype, plan_slices
from tierswap.optim.plan._probe import check_elementwise, probe_state


def _slot(index: int, numel: int, dtype: torch.dtype = torch.float32) -> Slot:
    param = torch.zeros(numel, dtype=dtype)
    return Slot(index, param, 0, master_dtype(param) != dtype, (4, 4))


@pytest.mark.parametrize(
    ("optimizer_class", "hyper", "expected"),
    [
        (torch.optim.AdamW, {"lr": 1e-3}, (4, 4)),
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}, (4, 4, 4)),
        (torch.optim.SGD, {"lr": 0.1}, ()),  # no momentum: no state
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, (4,)),
        (torch.optim.Adagrad, {"lr": 0.1}, (4,)),
        (torch.optim.RMSprop, {"lr": 0.1, "centered": True, "momentum": 0.5}, (4, 4, 4)),
    ],
)
def test_probe_lists_per_element_state(optimizer_class, hyper, expected) -> None:
    sizes = probe_state(optimizer_class, {"params": [], **hyper}, torch.float32).values()
    assert sorted(sizes) == sorted(expected)
    doubles = probe_state(optimizer_class, {"params": [], **hyper}, torch.float64).values()
    assert sorted(doubles) == sorted(2 * s for s in expected)


def test_working_set_counts_pages_and_masters() -> None:
    assert _slot(0, 1).working_set == 2 * 4096  # two one-page state tensors
    assert _slot(0, 2048).working_set == 2 * 8192
    bf16 = _slot(0, 2048, torch.bfloat16)
    assert bf16.has_master
    assert bf16.working_set == 2 * 8192 + 8192  # fp32 master of 2048 elements


def _covered(slices) -> dict[int, list[tuple[int, int]]]:
    ranges: dict[int, list[tuple[int, int]]] = {}
    for piece in slices:
        for seg in piece.segments:
            ranges.setdefault(seg.slot.index, []).append((seg.start, seg.stop))
    return ranges


def test_small_params_share_a_slice_and_large_ones_split_at_chunks() -> None:
    slots = [_slot(0, 100), _slot(1, 100), _slot(2, 10_000), _slot(3, 100)]
    slices = plan_slices(slots, target_bytes=5 * 8192, chunk_bytes=4096)
    ranges = _covered(slices)
    # every element of every slot is covered once, in order
    for slot in slots:
        spans = ranges[slot.index]
        assert spans[0][0] == 0
        assert spans[-1][1] == slot.local.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert [s.index for s in slices[0].slots][:2] == [0, 1]  # small ones share
    assert len(ranges[2]) > 1  # the large one spans several slices
    for start, _stop in ranges[2]:
        assert start % 1024 == 0  # splits at whole 4 KiB chunks of fp32
    for piece in slices:
        assert piece.working_set <= 5 * 8192 or len(piece.segments) == 1


def test_one_unit_larger_than_the_target_gets_its_own_slice() -> None:
    slices = plan_slices([_slot(0, 4096)], target_bytes=1, chunk_bytes=8192)
    assert [(s.segments[0].start, s.segments[0].stop) for s in slices] == [(0, 2048), (2048, 4096)]


def test_bf16_slices_count_master_and_gradient_cast() -> None:
    slot = _slot(0, 2048, torch.bfloat16)
    (piece,) = plan_slices([slot], target_bytes=1 << 20, chunk_bytes=4096)
    assert piece.working_set == 2 * 8192 + 2 * 8192  # state, then fp32 master and grad


def test_check_budget_names_the_minimum() -> None:
    slices = plan_slices([_slot(0, 8192), _slot(1, 16)], target_bytes=1, chunk_bytes=1 << 20)
    check_budget(slices, 65536, "host_budget")
    with pytest.raises(ConfigError, match=r"minimum is 64\.00 KiB \(65536 bytes\)"):
        check_budget(slices, 65535, "host_budget")


@pytest.mark.parametrize(
    ("optimizer_class", "hyper"),
    [
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.Rprop, {"lr": 0.1}),
        (torch.optim.ASGD, {"lr": 0.1}),
        (torch.optim.Adadelta, {"lr": 0.1}),
    ],
)
def test_per_element_optimizers_pass_the_slice_check(optimizer_class, hyper) -> None:
    check_elementwise(optimizer_class, {"params": [], **hyper}, torch.float32)


def test_factored_optimizers_are_refused() -> None:
    with pytest.raises(ConfigError, match="Adafactor"):
        check_elementwise(torch.optim.Adafactor, {"params": [], "lr": 1e-2}, torch.float32)

    class RowNorm(torch.optim.SGD):  # scales each update by the whole parameter's norm
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])

    with pytest.raises(ConfigError, match="not per element"):
        check_elementwise(RowNorm, {"params": [], "lr": 0.1}, torch.float32)
