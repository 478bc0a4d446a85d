"""Construction-time errors: budgets, a folder in use, unsupported optimizers, bad settings."""

from __future__ import annotations

import pytest
import torch

from tests.optim.models import make_models, min_host_budget
from tierswap.errors import ConfigError, StoreLockedError
from tierswap.optim import SwapOptimizer


def test_budget_below_largest_partition_names_the_minimum(tmp_path) -> None:
    model = torch.nn.Linear(128, 64)  # weight: 8192 floats; AdamW keeps 2 x 4 bytes each
    with pytest.raises(ConfigError, match=r"minimum is .*\(65536 bytes\)"):
        SwapOptimizer(model.parameters(), host_budget="63KiB", swap_dir=tmp_path / "s")
    assert min_host_budget(model.parameters(), torch.optim.AdamW) == 65536
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())
    SwapOptimizer(model.parameters(), host_budget=65536).close()


def test_device_budget_is_checked_too() -> None:
    model = torch.nn.Linear(128, 64)
    with pytest.raises(ConfigError, match="device_budget"):
        SwapOptimizer(model.parameters(), host_budget="1MiB", device_budget="1KiB")


def test_minimum_counts_masters_and_amsgrad_state() -> None:
    model = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    # fp32 master (4) + exp_avg, exp_avg_sq, max_exp_avg_sq (3 x 4) per element
    assert min_host_budget(model.parameters(), torch.optim.AdamW, amsgrad=True) == 8192 * 16


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
        ({"overlap": "forward"}, "overlap"),
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
