"""Optimizers whose math spans a parameter (torch.optim.Muon, Adafactor): whole-matrix slices,
bitwise equal to the same optimizer in memory."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.models import assert_same_params, assert_same_state, min_host_budget
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer, offload, swapped


class MatNet(torch.nn.Module):
    """Matrices of several sizes (Muon steps 2-D parameters only)."""

    def __init__(self, dtype: torch.dtype = torch.float32, bias: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 48, bias=bias, dtype=dtype)
        self.mid = torch.nn.Linear(48, 48, bias=bias, dtype=dtype)
        self.mid2 = torch.nn.Linear(48, 32, bias=bias, dtype=dtype)
        self.out = torch.nn.Linear(32, 4, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.mid2(x)))


CASES = {
    "muon": (torch.optim.Muon, {"lr": 0.02, "weight_decay": 0.01}, False),
    "adafactor": (torch.optim.Adafactor, {"lr": 0.01}, True),
}


def _models(dtype: torch.dtype, bias: bool) -> tuple[MatNet, MatNet]:
    torch.manual_seed(0)
    model = MatNet(dtype, bias)
    return model, copy.deepcopy(model)


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=gen).to(dtype)


def _train(model, opt, sched, step: int, dtype: torch.dtype) -> None:
    opt.zero_grad()
    model(_batch(step, dtype)).float().square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)  # clips: gradients big
    opt.step()
    sched.step()


def _reference_step(master_model, model, ref, sched, *, step: int, dtype: torch.dtype) -> None:
    """The plain optimizer over fp32 masters of a low-precision model (what tierswap does)."""
    ref.zero_grad()
    model.zero_grad()
    model(_batch(step, dtype)).float().square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)  # as the user's loop does
    for master, param in zip(master_model.parameters(), model.parameters(), strict=True):
        master.grad = param.grad.float()
    ref.step()
    sched.step()
    with torch.no_grad():
        for master, param in zip(master_model.parameters(), model.parameters(), strict=True):
            param.copy_(master)


def _streaming(model, optimizer_class, hyper, tmp_path) -> SwapOptimizer:
    """A SwapOptimizer of twice the smallest host budget: several whole-matrix slices stream."""
    budget = min_host_budget(model.named_parameters(), optimizer_class, **hyper) * 2
    return SwapOptimizer(
        model.named_parameters(), optimizer_class, swap_dir=tmp_path / "run",
        host_budget=budget, **hyper,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_matrix_optimizers_stream_whole_matrices_bitwise(case, tmp_path) -> None:
    optimizer_class, hyper, bias = CASES[case]
    ref_model, model = _models(torch.float32, bias)
    ref = optimizer_class(ref_model.named_parameters(), **hyper)
    opt = _streaming(model, optimizer_class, hyper, tmp_path)
    with opt:
        assert len(opt.slices) >= 3  # several slices' worth of budget
        for piece in opt.slices:  # whole parameters only
            assert all(
                seg.start == 0 and seg.stop == seg.slot.local.numel() for seg in piece.segments
            )
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref, opt)]
        for step in range(5):
            _train(ref_model, ref, scheds[0], step, torch.float32)
            _train(model, opt, scheds[1], step, torch.float32)
            assert_same_params(ref_model, model)
        assert_same_state(ref.state_dict(), opt.state_dict())
        assert opt.tier_stats()["nvme"]["bytes_read"] > 0  # the state streamed from disk


@pytest.mark.parametrize("case", CASES)
def test_bf16_matrices_step_their_fp32_masters_whole(case, tmp_path) -> None:
    optimizer_class, hyper, bias = CASES[case]
    torch.manual_seed(0)
    model = MatNet(torch.bfloat16, bias)
    master_model = copy.deepcopy(model).float()  # the masters start from the bf16 weights
    swap_model = copy.deepcopy(model)
    ref = optimizer_class(master_model.named_parameters(), **hyper)
    opt = _streaming(swap_model, optimizer_class, hyper, tmp_path)
    with opt:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref, opt)]
        for step in range(4):
            _reference_step(master_model, model, ref, scheds[0], step=step, dtype=torch.bfloat16)
            _train(swap_model, opt, scheds[1], step, torch.bfloat16)
            assert_same_params(model, swap_model)
        assert_same_state(ref.state_dict(), opt.state_dict())


def test_mixed_muon_and_adamw_in_one_optimizer(tmp_path) -> None:
    """The common recipe: Muon for hidden matrices, AdamW for the rest, one SwapOptimizer."""
    ref_model, model = _models(torch.float32, bias=True)

    def groups(m):
        hidden = [(n, p) for n, p in m.named_parameters() if p.dim() == 2 and n != "out.weight"]
        rest = [(n, p) for n, p in m.named_parameters() if (n, p) not in hidden]
        return [
            {"params": [p for _, p in hidden], "param_names": [n for n, _ in hidden],
             "optimizer_class": torch.optim.Muon, "lr": 0.02},
            {"params": [p for _, p in rest], "param_names": [n for n, _ in rest]},
        ]  # fmt: skip

    ref_groups = groups(ref_model)
    muon = torch.optim.Muon([{k: v for k, v in ref_groups[0].items() if k != "optimizer_class"}])
    adamw = torch.optim.AdamW([ref_groups[1]], lr=3e-3, weight_decay=0.1)
    opt = SwapOptimizer(
        groups(model), torch.optim.AdamW, swap_dir=tmp_path / "run", host_budget="96KiB",
        lr=3e-3, weight_decay=0.1,
    )  # fmt: skip
    with opt:
        assert opt.param_groups[0]["weight_decay"] == muon.param_groups[0]["weight_decay"]
        assert opt.param_groups[1]["betas"] == adamw.param_groups[0]["betas"]
        for step in range(4):
            for o in (muon, adamw, opt):
                o.zero_grad()
            x = _batch(step, torch.float32)
            ref_model(x).square().mean().backward()
            model(x).square().mean().backward()
            muon.step()
            adamw.step()
            opt.step()
            assert_same_params(ref_model, model)
        state = opt.state_dict()
        assert set(state["state"][0]) == {"momentum_buffer"}
        assert set(state["state"][len(ref_groups[0]["params"])]) >= {"exp_avg", "exp_avg_sq"}


def test_a_matrix_larger_than_the_budget_is_named(tmp_path) -> None:
    model = MatNet()
    swap_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"parameter 'mid.weight' of shape \(48, 48\)") as info:
        SwapOptimizer(
            model.named_parameters(), torch.optim.Muon, swap_dir=swap_dir, host_budget="40KiB"
        )
    assert "the minimum is" in str(info.value)
    assert not swap_dir.exists() or not any(swap_dir.iterdir())  # nothing written


def test_muon_refuses_vectors(tmp_path) -> None:
    model = MatNet(bias=True)
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):  # torch's check
        SwapOptimizer(model.named_parameters(), torch.optim.Muon, swap_dir=tmp_path / "run")


@pytest.mark.parametrize("case", CASES)
def test_offload_swapped_and_resume(case, tmp_path) -> None:
    optimizer_class, hyper, bias = CASES[case]
    ref_model, model = _models(torch.float32, bias)
    ref = optimizer_class(ref_model.parameters(), **hyper)
    plain = optimizer_class(model.parameters(), **hyper)
    opt = offload(plain, swap_dir=tmp_path / "run", host_budget="160KiB", commit_every=1)
    for step in range(2):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            m(_batch(step, torch.float32)).square().mean().backward()
            o.step()
    opt.close()
    _, resumed_model = _models(torch.float32, bias)  # the resume overwrites these weights
    opt = swapped(optimizer_class)(
        resumed_model.parameters(), swap_dir=tmp_path / "run", host_budget="160KiB",
        resume=True, **hyper,
    )  # fmt: skip
    with opt:
        assert opt.steps == 2
        assert_same_params(ref_model, resumed_model)
        assert_same_state(ref.state_dict(), opt.state_dict())
