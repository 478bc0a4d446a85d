"""The streaming step: bitwise equal in slices, each byte read once and written once, bounded."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.models import settled_step
from tests.optim.test_optimizer import OPTIMIZERS
from tierswap.optim import SwapOptimizer


class Mixed(torch.nn.Module):
    """A parameter much larger than a slice, beside small ones that share slices."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(96, 512)  # 49152 weights: 48 chunks of 4 KiB in fp32
        self.small = torch.nn.Linear(512, 3)
        self.scale = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.tanh(self.big(x))) * self.scale


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


def _master_step(
    model: torch.nn.Module,
    masters: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
) -> None:
    """The reference of a low-precision model: ``opt`` steps fp32 masters, copied back."""
    model.zero_grad()
    model(x).float().square().mean().backward()
    for master, param in zip(masters, model.parameters(), strict=True):
        master.grad = param.grad.float()
    opt.step()
    with torch.no_grad():
        for master, param in zip(masters, model.parameters(), strict=True):
            param.copy_(master)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_split_and_share_parameters_bitwise(name: str, dtype: torch.dtype) -> None:
    optimizer_class, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    plain_model = Mixed().to(dtype)
    swap_model = copy.deepcopy(plain_model)
    if dtype == torch.bfloat16:  # the reference: fp32 masters stepped in memory
        masters = [p.detach().float().requires_grad_() for p in plain_model.parameters()]
        plain = optimizer_class(masters, **kwargs)
    else:
        plain = optimizer_class(plain_model.parameters(), **kwargs)
    swap = SwapOptimizer(swap_model.parameters(), optimizer_class, host_budget="96KiB", **kwargs)
    with swap:
        assert any(len(s.segments) > 1 for s in swap.slices), "no slice shared by parameters"
        weight = swap_model.big.weight
        split = [s for s in swap.slices if any(g.slot.param is weight for g in s.segments)]
        assert len(split) > 1, "the large parameter was not split"
        for x in torch.randn(4, 5, 96):
            _step(swap_model, swap, x.to(dtype))
            if dtype == torch.bfloat16:
                plain.zero_grad()
                _master_step(plain_model, masters, plain, x.to(dtype))
            else:
                _step(plain_model, plain, x)
        for a, b in zip(plain_model.parameters(), swap_model.parameters(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("overlap", [None, "auto"])
def test_each_state_byte_is_read_once_and_written_once_per_step(tmp_path, overlap) -> None:
    """Each state byte is read once and written once a step; a speculative step (``"auto"``,
    nothing redone) writes each parameter's pre-step value besides (what a redo restores)."""
    torch.manual_seed(0)
    model = Mixed()
    numel = sum(p.numel() for p in model.parameters())
    swap = SwapOptimizer(
        model.parameters(), lr=1e-3, host_budget="40KiB", commit_every=0,
        swap_dir=tmp_path / "s", overlap=overlap,
    )  # fmt: skip
    pre_step = 4 * numel if overlap == "auto" else 0
    state = 2 * 4 * numel  # exp_avg and exp_avg_sq, fp32
    with swap:
        assert not swap.placement, "the budget holds no resident slice: every byte streams"
        xs = torch.randn(4, 5, 96)
        _step(model, swap, xs[0])  # creates the state (sparse files, then one write)
        swap._backend.pipeline.drain()  # the last writes of a step end during the next one
        for x in xs[1:]:
            before = swap.tier_stats()["nvme"]
            settled_step(model, swap, x)
            swap._backend.pipeline.drain()
            after = swap.tier_stats()["nvme"]
            assert after["bytes_read"] - before["bytes_read"] == state
            assert after["bytes_written"] - before["bytes_written"] == state + pre_step
        if overlap == "auto":
            assert swap.tier_stats()["schedule"]["speculated"] == 3 * len(swap.slices)  # steps 2-4
            assert swap.tier_stats()["schedule"]["redone"] == 0
        # a due commit adds the parameters' bytes once, written with their slices (or, when
        # they stepped speculatively, by the commit)
        swap._parts.commits.every = 1
        before = swap.tier_stats()["nvme"]
        settled_step(model, swap, xs[0])
        after = swap.tier_stats()["nvme"]
        assert after["bytes_read"] - before["bytes_read"] == state
        written = after["bytes_written"] - before["bytes_written"]
        assert state + pre_step + 4 * numel <= written < state + pre_step + 4 * numel + 64 * 1024


@pytest.mark.parametrize("overlap", [None, "auto"])
def test_pipeline_holds_at_most_the_host_budget(overlap) -> None:
    torch.manual_seed(0)
    model = Mixed()
    swap = SwapOptimizer(model.parameters(), lr=1e-3, host_budget="40KiB", overlap=overlap)
    with swap:
        for x in torch.randn(3, 5, 96):
            _step(model, swap, x)
        peak = swap.tier_stats()["host"]["peak"]
        assert peak <= 40 * 1024
        assert peak > max(s.working_set for s in swap.slices)  # more than one in flight


def test_a_step_without_gradients_still_commits_when_due(tmp_path) -> None:
    model = Mixed()
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", commit_every=1) as swap:
        _step(model, swap, torch.randn(5, 96))
        swap.zero_grad()
        swap.step()  # no parameter has a gradient: nothing steps, the count and commit go on
        assert swap.steps == 2
        assert swap._backend.committed_meta()["steps"] == 2
