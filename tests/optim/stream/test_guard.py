"""Streamed parameters used where no hook of their own module runs (the StreamedParameter
guard): a parent's forward, ``nn.MultiheadAttention``'s functional form, the training loop."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.optim.models import batch_for_step
from tierswap.optim import SwapOptimizer
from tierswap.optim.stream._guard import StreamedParameter

KWARGS = {"lr": 1e-2, "weight_decay": 0.05}


class Borrowing(torch.nn.Module):
    """The root's forward reads its children's parameters itself: a head tied to the first
    layer's weight (through a view) and an elementwise use of a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.inp(x)))
        return torch.nn.functional.linear(h, self.inp.weight.t()) * (1 + self.mid.bias.mean())


class Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` hands ``out_proj``'s parameters to its functional form: the
    ``out_proj`` module never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x.view(2, 3, 8)))


def _held(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _penalty(model: torch.nn.Module) -> torch.Tensor:
    return 1e-3 * sum(p.square().sum() for p in model.parameters())  # type: ignore[return-value]


def _train_pair(
    tmp_path: Path, make: type[torch.nn.Module], steps: int, penalty: str | None = None
) -> tuple[torch.nn.Module, SwapOptimizer]:
    """Train ``make()`` with torch's AdamW and a copy with streamed parameters, in lock-step
    (``penalty``: a weight penalty on every parameter, computed "before" or "after" the
    forward, in the training loop); check them bitwise at each step and return the streamed
    one and its optimizer (still open)."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=20480,
        offload_parameters=True, **KWARGS,
    )  # fmt: skip
    for step in range(steps):
        for m, o in ((ref, plain), (model, opt)):
            before = _penalty(m) if penalty == "before" else 0.0
            loss = m(batch_for_step(step)).square().mean() + before
            if penalty == "after":
                loss = loss + _penalty(m)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
        assert _held(model) == 0  # every parameter is back in the swap space
        expected = ref.state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), (step, key)
    return model, opt


@pytest.mark.parametrize("make", [Borrowing, Attention])
def test_parameters_used_outside_their_modules_forward_train_bitwise(
    tmp_path: Path, make: type[torch.nn.Module]
) -> None:
    model, opt = _train_pair(tmp_path, make, 4)
    fetched = opt.tier_stats()["parameters"]["fetched_bytes"]
    model(batch_for_step(9)).sum().backward()  # an iteration reads each use's values once
    per_iteration = opt.tier_stats()["parameters"]["fetched_bytes"] - fetched
    assert per_iteration <= 2 * _values(model)  # forward and backward
    opt.zero_grad()
    opt.close()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert _held(model) == _values(model)


def _values(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("penalty", ["before", "after"])
def test_a_weight_penalty_in_the_training_loop_trains_bitwise(tmp_path: Path, penalty: str) -> None:
    _, opt = _train_pair(tmp_path, Borrowing, 3, penalty)
    opt.close()


def test_a_freed_parameter_is_read_for_a_use_between_steps(tmp_path: Path) -> None:
    model, opt = _train_pair(tmp_path, Borrowing, 2)
    weight = model.mid.weight
    assert isinstance(weight, StreamedParameter)
    assert "swap space" in repr(weight)  # repr reads no values while it holds none
    expected = model.state_dict()["mid.weight"]
    with torch.no_grad():
        assert torch.equal(weight + 1, expected + 1)  # an elementwise kernel: it reads them
        assert torch.equal(weight.view(-1)[:5], expected.view(-1)[:5])
    assert "Parameter containing" in repr(weight)  # it holds its values now
    model(batch_for_step(5)).sum().backward()  # then trains on
    opt.step()
    assert _held(model) == 0
    stored = model.state_dict()
    opt.close()  # gives every parameter its values back: the stored ones
    for name, param in model.named_parameters():
        assert type(param) is torch.nn.Parameter
        assert torch.equal(param, stored[name]), name
