"""The slots of a param group: what the optimizer records for each parameter."""

from __future__ import annotations

import pytest
import torch

from tierswap.errors import ConfigError
from tierswap.optim._config import SwapConfig
from tierswap.optim.plan._slots import group_slots, inner_for

CPU = torch.device("cpu")


def _slots(params, optimizer_class=torch.optim.AdamW, **config):
    group = {"params": params, **optimizer_class([torch.zeros(2, 2)]).defaults}
    return group_slots(
        group, group_index=3, first=5, optimizer_class=optimizer_class,
        config=SwapConfig(**config), compute_device=CPU,
    )  # fmt: skip


def test_each_parameter_gets_a_numbered_slot_with_its_probed_state() -> None:
    params = [torch.zeros(8, requires_grad=True), torch.zeros(3, 4, requires_grad=True)]
    slots = _slots(params)
    assert [s.index for s in slots] == [5, 6]
    assert all(s.group == 3 for s in slots)
    assert [s.param for s in slots] == params
    assert slots[0].state_names == ("exp_avg", "exp_avg_sq")
    assert slots[0].whole_state is None  # AdamW's math is per element: cut freely
    assert not slots[0].has_master


def test_bf16_parameters_get_masters_and_remainders_only_when_asked() -> None:
    params = [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)]
    fp32_masters = _slots(params)
    assert [s.has_master for s in fp32_masters] == [True, False]
    assert not any(s.remainder for s in fp32_masters)
    remainders = _slots(params, master="remainder", state_precision="bf16")
    assert [s.remainder for s in remainders] == [True, False]
    assert all(s.precision == "bf16" for s in remainders)


def test_muon_matrices_step_whole() -> None:
    (slot,) = _slots([torch.zeros(4, 6)], torch.optim.Muon)
    assert slot.whole_state is not None
    assert "momentum_buffer" in slot.whole_state


def test_a_parameter_that_is_not_contiguous_is_refused() -> None:
    with pytest.raises(ConfigError, match="not contiguous"):
        _slots([torch.zeros(4, 6).t()])


def test_groups_of_one_class_share_one_torch_optimizer() -> None:
    inner = torch.optim.AdamW([torch.zeros(1)])
    assert inner_for(torch.optim.AdamW, inner, []) is inner
    muon = inner_for(torch.optim.Muon, inner, [inner])
    assert type(muon) is torch.optim.Muon
    assert inner_for(torch.optim.Muon, inner, [inner, muon]) is muon
