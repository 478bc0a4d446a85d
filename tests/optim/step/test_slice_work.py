"""Cut parameters step on the CPU in blocks (``_slice_work.STEP_BLOCK``): bitwise the same as
the plain optimizer on whole parameters, for every per-element optimizer, state format and
master format."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batches,
    groups,
    make_models,
    min_host_budget,
    train_step,
)
from tests.optim.test_optimizer import OPTIMIZERS
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import _slice_work

BLOCK = 64  # smaller than the weights of TinyNet (a multiple of 64, as STEP_BLOCK is)


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Small blocks; records the size of every tensor each inner step is given."""
    monkeypatch.setattr(_slice_work, "STEP_BLOCK", BLOCK)
    sizes: list[int] = []
    step_inner = _slice_work._step_inner

    def recording(inner: Any, groups: list[dict[str, Any]], state: Any) -> None:
        sizes.extend(p.numel() for g in groups for p in g["params"])
        step_inner(inner, groups, state)

    monkeypatch.setattr(_slice_work, "_step_inner", recording)
    return sizes


def _lock_step(optimizer_class: type, kwargs: dict[str, Any], tmp_path: Any, **swap: Any) -> None:
    plain_model, swap_model = make_models()
    plain = optimizer_class(groups(plain_model, lr=3e-3), **kwargs)
    budget = min_host_budget(groups(swap_model, lr=3e-3), optimizer_class, **kwargs)
    opt = SwapOptimizer(
        groups(swap_model, lr=3e-3), optimizer_class, swap_dir=tmp_path / "run",
        host_budget=budget, **kwargs, **swap,
    )  # fmt: skip
    with opt:
        for x in batches(4):
            train_step(plain_model, plain, x)
            train_step(swap_model, opt, x)
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), opt.state_dict())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_blocks_step_bitwise_like_whole_parameters(
    name: str, blocks: list[int], tmp_path: Any
) -> None:
    optimizer_class, kwargs = OPTIMIZERS[name]
    _lock_step(optimizer_class, kwargs, tmp_path)
    # steps with state step in blocks, unless the kernel is fused (blocks do not pay)
    assert (BLOCK in blocks) is not kwargs.get("fused", False)


class _Replacing(torch.optim.Optimizer):
    """Per-element momentum that replaces its state tensor each step instead of updating it in
    place: the blocks' results must be joined, not read back through views."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.get("buf")
                state["buf"] = p.grad.clone() if buf is None else buf * 0.9 + p.grad
                state["count"] = state.get("count", 0) + 1
                p.add_(state["buf"], alpha=-group["lr"])


def test_state_that_torch_replaces_is_joined(blocks: list[int], tmp_path: Any) -> None:
    _lock_step(_Replacing, {"lr": 0.05}, tmp_path)
    assert BLOCK in blocks


@pytest.mark.parametrize(
    ("precision", "dtype", "master"),
    [
        ("bf16", torch.float32, "fp32"),
        ("8bit", torch.float32, "fp32"),
        ("fp32", torch.bfloat16, "fp32"),
        ("fp32", torch.bfloat16, "remainder"),
        ("8bit", torch.bfloat16, "remainder"),
    ],
)
def test_blocks_match_whole_slices_with_compact_state_and_masters(
    precision: str, dtype: torch.dtype, master: str, blocks: list[int], tmp_path: Any
) -> None:
    """Compact moments decode into whole-slice scratch and masters of bf16 parameters are
    joined or read whole, then step in blocks: the same result as without blocks (the block
    size does not change the numbers)."""
    results = []
    for block in (BLOCK, 1 << 30):
        _slice_work.STEP_BLOCK = block  # the fixture restores it
        _, model = make_models(dtype=dtype)
        opt = SwapOptimizer(
            groups(model), torch.optim.AdamW, swap_dir=tmp_path / f"run{block}", lr=1e-2,
            host_budget=None, state_precision=precision, master=master,
        )  # fmt: skip
        with opt:
            for x in batches(4, dtype=dtype):
                train_step(model, opt, x)
            results.append(
                ([p.detach().clone() for p in model.parameters()], opt.state_dict()["state"])
            )
    assert BLOCK in blocks
    (params_a, state_a), (params_b, state_b) = results
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(a, b)
    for index, values in state_a.items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[index][name]))
