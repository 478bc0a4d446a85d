"""Partitioning, state-size probing and the write-behind choice."""

from __future__ import annotations

import pytest
import torch

from tierswap.errors import ConfigError
from tierswap.optim._partition import (
    Slot,
    check_budget,
    master_dtype,
    partition_slots,
    probe_state_itemsizes,
)
from tierswap.optim.optimizer import _write_behind


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
    sizes = probe_state_itemsizes(optimizer_class, {"params": [], **hyper}, torch.float32)
    assert sorted(sizes) == sorted(expected)
    doubles = probe_state_itemsizes(optimizer_class, {"params": [], **hyper}, torch.float64)
    assert sorted(doubles) == sorted(2 * s for s in expected)


def test_working_set_counts_pages_and_masters() -> None:
    assert _slot(0, 1).working_set == 2 * 4096  # two one-page state tensors
    assert _slot(0, 2048).working_set == 2 * 8192
    bf16 = _slot(0, 2048, torch.bfloat16)
    assert bf16.has_master
    assert bf16.working_set == 2 * 8192 + 8192  # fp32 master of 2048 elements


def test_partitions_pack_in_order_and_never_split() -> None:
    slots = [_slot(i, n) for i, n in enumerate([1024, 1024, 1024, 8192, 1024])]
    parts = partition_slots(slots, target_bytes=3 * 8192)
    # 8 KiB each, except slot 3 (64 KiB: larger than the target, so alone)
    assert [[s.index for s in p.slots] for p in parts] == [[0, 1, 2], [3], [4]]
    assert [p.index for p in parts] == [0, 1, 2]


def test_check_budget_names_the_minimum() -> None:
    parts = partition_slots([_slot(0, 8192), _slot(1, 16)], target_bytes=1)
    check_budget(parts, 65536, "host_budget")
    with pytest.raises(ConfigError, match=r"minimum is 64\.00 KiB \(65536 bytes\)"):
        check_budget(parts, 65535, "host_budget")


def test_write_behind_keeps_a_resident_prefix() -> None:
    parts = partition_slots([_slot(i, 1024) for i in range(12)], target_bytes=8192)
    assert len(parts) == 12
    assert _write_behind(parts, budget=12 * 8192) == set()  # everything fits: no eviction
    evicted = _write_behind(parts, budget=6 * 8192)
    assert evicted == set(range(2, 12))  # the first third of the budget stays resident
