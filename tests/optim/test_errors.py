"""Construction-time errors: budgets, a folder in use, unsupported optimizers, bad settings."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.models import make_models, min_host_budget
from tierswap.errors import ConfigError, StoreLockedError
from tierswap.optim import SwapOptimizer


def test_budget_below_one_slice_names_the_minimum(tmp_path) -> None:
    model = torch.nn.Linear(128, 64)  # weight: 8192 floats; AdamW keeps 2 x 4 bytes each
    # The smallest slice is one 4 KiB chunk of each state array: 1024 elements x 8 bytes.
    with pytest.raises(ConfigError, match=r"minimum is .*\(8192 bytes\)"):
        SwapOptimizer(model.parameters(), host_budget="4KiB", swap_dir=tmp_path / "s")
    assert min_host_budget(model.parameters(), torch.optim.AdamW) == 8192
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_parameter_larger_than_the_budget_is_stepped_in_slices(tmp_path) -> None:
    plain_model = torch.nn.Linear(128, 64)
    swap_model = copy.deepcopy(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    # the weight's state alone is 64 KiB: eight times the budget
    swap = SwapOptimizer(
        swap_model.parameters(), lr=1e-2, host_budget=8192, swap_dir=tmp_path / "s"
    )
    with swap:
        for x in torch.randn(3, 4, 128):
            for model, opt in ((plain_model, plain), (swap_model, swap)):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        assert len(swap.slices) > 8
        assert torch.equal(plain_model.weight, swap_model.weight)
        assert torch.equal(plain_model.bias, swap_model.bias)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streamed slices step on a GPU only")
def test_device_budget_is_checked_where_slices_step_on_the_device() -> None:
    model = torch.nn.Linear(128, 64)
    with pytest.raises(ConfigError, match="device_budget"):
        SwapOptimizer(model.parameters(), host_budget="1MiB", device_budget="1KiB")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU slices step there: the budget is checked (above)"
)
def test_a_device_tier_smaller_than_a_slice_holds_nothing(tmp_path) -> None:
    model = torch.nn.Linear(128, 64)
    with SwapOptimizer(
        model.parameters(), swap_dir=tmp_path / "s", host_budget="1MiB", device_budget="1KiB"
    ) as opt:
        model(torch.randn(2, 128)).sum().backward()
        opt.step()
        device = opt.tier_stats()["device"]
        assert device["used"] == device["hits"] == 0
        assert device["budget"] == 1024


def test_minimum_counts_masters_and_amsgrad_state() -> None:
    model = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    # exp_avg, exp_avg_sq, max_exp_avg_sq (3 x 4), fp32 master (4) and its fp32 gradient (4)
    # per element, for the smallest slice: one 4 KiB chunk of fp32, 1024 elements
    assert min_host_budget(model.parameters(), torch.optim.AdamW, amsgrad=True) == 1024 * 20


def test_minimum_counts_whole_pages() -> None:
    model = torch.nn.Linear(10, 10, bias=False)  # 400 bytes per state tensor: one page each
    assert min_host_budget(model.parameters(), torch.optim.AdamW) == 2 * 4096


def test_swap_folder_in_use_raises_store_locked(tmp_path) -> None:
    _, model = make_models()
    with (
        SwapOptimizer(model.parameters(), swap_dir=tmp_path / "run"),
        pytest.raises(StoreLockedError),
    ):
        SwapOptimizer(model.parameters(), swap_dir=tmp_path / "run")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"commit_every": -1}, "commit_every"),
        ({"overlap": "sideways"}, "overlap"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"host_budget": "lots"}, "host_budget"),
        ({"resume": True}, "resume=True needs swap_dir"),
    ],
)
def test_bad_settings(kwargs: dict, match: str) -> None:
    _, model = make_models()
    with pytest.raises(ConfigError, match=match):
        SwapOptimizer(model.parameters(), **kwargs)


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, dict])
def test_unsupported_optimizer_classes(cls: type) -> None:
    _, model = make_models()
    with pytest.raises(ConfigError, match="optimizer_class"):
        SwapOptimizer(model.parameters(), cls)


def test_temporary_folder_is_removed_at_close() -> None:
    _, model = make_models()
    swap = SwapOptimizer(model.parameters())
    path = swap.swap_dir
    assert path.exists()
    swap.close()
    assert not path.exists()
