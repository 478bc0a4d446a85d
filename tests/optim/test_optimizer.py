"""Bitwise equivalence of SwapOptimizer with the plain torch optimizer, tier by tier."""

from __future__ import annotations

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
from tierswap.optim import SwapOptimizer

OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    "AdamW-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9, "centered": True}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2, "decoupled_weight_decay": True}),
}
STEPS = 4


def _tiers(config: str, minimum: int) -> dict[str, object]:
    if config == "ram":
        return {"host_budget": None}
    if config == "nvme":  # room for one partition: every step re-reads all state
        return {"host_budget": minimum}
    return {"host_budget": minimum, "device_budget": minimum}


@pytest.mark.parametrize("config", ["ram", "nvme", "device"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equivalence_matrix(name: str, config: str) -> None:
    optimizer_class, kwargs = OPTIMIZERS[name]
    plain_model, swap_model = make_models()
    plain = optimizer_class(groups(plain_model, lr=3e-3), **kwargs)
    minimum = min_host_budget(groups(swap_model, lr=3e-3), optimizer_class, **kwargs)
    swap = SwapOptimizer(
        groups(swap_model, lr=3e-3), optimizer_class, **_tiers(config, minimum), **kwargs
    )
    with swap:
        for x in batches(STEPS):
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())
        nvme = swap.tier_stats()["nvme"]
        if config != "ram" and minimum:
            assert nvme["bytes_read"] > 0, "a one-partition budget must re-read state"


def test_schedulers_tensor_lr_zero_grad_clip_and_closure() -> None:
    plain_model, swap_model = make_models()
    lr = 1e-2
    plain = torch.optim.Adam(plain_model.parameters(), lr=torch.tensor(lr))
    swap = SwapOptimizer(swap_model.parameters(), torch.optim.Adam, lr=torch.tensor(lr))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, swap)]
    with swap:
        for x in batches(3):
            for model, opt, sched in zip(
                (plain_model, swap_model), (plain, swap), scheds, strict=True
            ):
                opt.zero_grad(set_to_none=False)

                def closure(model=model, x=x):
                    loss = model(x).square().mean()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                    return loss

                opt.step(closure)
                sched.step()
        assert swap.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
        assert_same_params(plain_model, swap_model)


def test_grad_scaler() -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    swap = SwapOptimizer(swap_model.parameters(), torch.optim.AdamW, lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**20) for _ in range(2)]
    with swap:
        for i, x in enumerate(batches(4)):
            for model, opt, scaler in zip(
                (plain_model, swap_model), (plain, swap), scalers, strict=True
            ):
                opt.zero_grad()
                loss = model(x).square().mean() * (float("inf") if i == 1 else 1.0)
                scaler.scale(loss).backward()
                scaler.step(opt)  # step 1 has inf grads: both skip it
                scaler.update()
        assert swap.steps == 3
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())


def _reference_mixed_step(model, masters, opt, x):
    """Hand-written fp32-master training: the reference for bf16 params."""
    for p in model.parameters():
        p.grad = None
    model(x).float().square().mean().backward()
    for p, m in zip(model.parameters(), masters, strict=True):
        m.grad = None if p.grad is None else p.grad.float()
    opt.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters, strict=True):
            p.copy_(m)


@pytest.mark.parametrize("config", ["ram", "nvme"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_keeps_fp32_masters(dtype: torch.dtype, config: str) -> None:
    ref_model, swap_model = make_models(dtype=dtype)
    masters = [p.detach().float().requires_grad_() for p in ref_model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2)
    minimum = min_host_budget(swap_model.parameters(), torch.optim.AdamW, lr=1e-2)
    budget = minimum if config == "nvme" else None
    swap = SwapOptimizer(swap_model.parameters(), torch.optim.AdamW, lr=1e-2, host_budget=budget)
    with swap:
        for x in batches(4, dtype=dtype):
            _reference_mixed_step(ref_model, masters, ref, x)
            train_step(swap_model, swap, x)
        assert_same_params(ref_model, swap_model)
        assert all(s.has_master for s in swap._layout.slots)
        state = swap.state_dict()["state"]
        for index, ref_state in ref.state_dict()["state"].items():
            assert torch.equal(ref_state["exp_avg"], state[index]["exp_avg"])
            assert state[index]["exp_avg"].dtype == torch.float32
