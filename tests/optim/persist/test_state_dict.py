"""State dicts in torch's format, and commit / resume through the swap folder."""

from __future__ import annotations

import gc
import io

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
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer


def _roundtrip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("budget", [None, 8192])
def test_state_dict_roundtrip_through_torch_save(budget: int | None) -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.AdamW(groups(plain_model, lr=1e-3), lr=1e-2)
    first = SwapOptimizer(groups(swap_model, lr=1e-3), lr=1e-2, host_budget=budget)
    data = batches(6)
    for x in data[:3]:
        train_step(plain_model, plain, x)
        train_step(swap_model, first, x)
    saved = _roundtrip(first.state_dict())
    first.close()
    assert_same_state(plain.state_dict(), saved)
    second = SwapOptimizer(groups(swap_model), lr=5.0, host_budget=budget)  # groups come back
    with second:
        second.load_state_dict(saved)
        assert second.param_groups[1]["lr"] == 1e-3
        for x in data[3:]:
            train_step(plain_model, plain, x)
            train_step(swap_model, second, x)
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), second.state_dict())


def test_into_plain_adamw_and_back() -> None:
    plain_model, swap_model = make_models()
    swap = SwapOptimizer(swap_model.parameters(), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    data = batches(6)
    for x in data[:2]:
        train_step(plain_model, plain, x)
        train_step(swap_model, swap, x)
    # swap -> plain: the plain optimizer continues where the swapped one stopped
    other = torch.optim.AdamW(swap_model.parameters(), lr=1.0)
    other.load_state_dict(_roundtrip(swap.state_dict()))
    for x in data[2:4]:
        train_step(plain_model, plain, x)
        train_step(swap_model, other, x)
    assert_same_params(plain_model, swap_model)
    # plain -> swap
    swap.load_state_dict(_roundtrip(other.state_dict()))
    for x in data[4:]:
        train_step(plain_model, plain, x)
        train_step(swap_model, swap, x)
    assert_same_params(plain_model, swap_model)
    assert_same_state(plain.state_dict(), swap.state_dict())
    swap.close()


def test_load_rejects_a_mismatched_state_dict() -> None:
    _, model = make_models()
    with SwapOptimizer(model.parameters()) as swap:
        bad = {"state": {}, "param_groups": [{"params": [0, 1]}]}
        with pytest.raises(ValueError, match="parameter group"):
            swap.load_state_dict(bad)


def test_commit_and_resume_in_process(tmp_path) -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    data = batches(6)
    kwargs = {"swap_dir": tmp_path / "run", "host_budget": 8192, "lr": 1e-2}
    swap = SwapOptimizer(swap_model.parameters(), **kwargs, commit_every=2)
    for x in data[:3]:
        train_step(plain_model, plain, x)
        train_step(swap_model, swap, x)
    del swap  # lost without close() (a kill): its finalizer releases the folder, no commit
    gc.collect()
    # step 3 was not committed: the resumed run restarts from step 2, so replay it
    plain_model2, _ = make_models()
    plain2 = torch.optim.AdamW(plain_model2.parameters(), lr=1e-2)
    for x in data[:2]:
        train_step(plain_model2, plain2, x)
    _, fresh_model = make_models(seed=7)  # different weights: resume must overwrite them
    with SwapOptimizer(fresh_model.parameters(), **kwargs, resume=True) as resumed:
        assert resumed.steps == 2
        assert_same_params(plain_model2, fresh_model)
        assert_same_state(plain2.state_dict(), resumed.state_dict())
        for x in data[2:]:
            train_step(plain_model2, plain2, x)
            train_step(fresh_model, resumed, x)
        assert_same_params(plain_model2, fresh_model)


def test_a_state_loaded_after_a_committed_step_commits_the_loaded_weights(tmp_path) -> None:
    """A step that commits writes the params it stepped, and the next commit skips them; a
    state loaded in between (weights and optimizer, as a trainer's checkpoint load does)
    changes them, so that commit writes them again: the resume holds the loaded state, not the
    weights of the last step."""
    plain_model, swap_model = make_models()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    data = batches(3)
    train_step(plain_model, plain, data[0])
    kwargs = {"swap_dir": tmp_path / "run", "host_budget": 8192, "lr": 1e-2}
    with SwapOptimizer(swap_model.parameters(), **kwargs, commit_every=1) as swap:
        for x in data[:2]:
            train_step(swap_model, swap, x)
        swap_model.load_state_dict(plain_model.state_dict())
        swap.load_state_dict(plain.state_dict())
        swap.commit()
    _, fresh_model = make_models(seed=7)
    with SwapOptimizer(fresh_model.parameters(), **kwargs, resume=True) as resumed:
        assert_same_params(plain_model, fresh_model)
        assert_same_state(plain.state_dict(), resumed.state_dict())
        train_step(plain_model, plain, data[2])
        train_step(fresh_model, resumed, data[2])
        assert_same_params(plain_model, fresh_model)


def test_resume_with_mixed_precision_restores_masters(tmp_path) -> None:
    _, model = make_models(dtype=torch.bfloat16)
    kwargs = {"swap_dir": tmp_path / "run", "lr": 1e-2}
    with SwapOptimizer(model.parameters(), **kwargs) as swap:
        for x in batches(2, dtype=torch.bfloat16):
            train_step(model, swap, x)
        swap.commit()  # the masters of resident slices reach the store at commits
        masters = [swap._backend.read(s.master_key) for s in swap._layout.slots]
    _, other = make_models(seed=3, dtype=torch.bfloat16)
    with SwapOptimizer(other.parameters(), **kwargs, resume=True) as resumed:
        for slot, master in zip(resumed._layout.slots, masters, strict=True):
            assert torch.equal(resumed._backend.read(slot.master_key), master)
            assert torch.equal(slot.param, master.to(torch.bfloat16))


def test_resume_rejects_another_layout(tmp_path) -> None:
    _, model = make_models()
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "run") as swap:
        train_step(model, swap, batches(1)[0])
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ConfigError, match="another parameter layout"):
        SwapOptimizer(other.parameters(), swap_dir=tmp_path / "run", resume=True)


def test_resume_of_an_empty_folder_starts_fresh(tmp_path) -> None:
    plain_model, swap_model = make_models()
    with SwapOptimizer(swap_model.parameters(), swap_dir=tmp_path / "new", resume=True) as swap:
        assert swap.steps == 0
        assert_same_params(plain_model, swap_model)
