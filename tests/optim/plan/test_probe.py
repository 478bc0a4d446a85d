"""What the probes tell of optimizer classes: cut, whole, or refused; and state shapes."""

from __future__ import annotations

import pytest
import torch

from tierswap.errors import ConfigError
from tierswap.optim.plan._probe import may_slice, probe_whole_state


class RowNorm(torch.optim.SGD):
    """Scales each update by its own parameter's gradient norm: math that spans a parameter."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


class GroupNorm(torch.optim.SGD):
    """Scales every update by the norm over the whole group: math that mixes parameters."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            norm = torch.stack([p.grad.norm() for p in group["params"]]).norm()
            for p in group["params"]:
                p.add_(p.grad / norm, alpha=-group["lr"])


@pytest.mark.parametrize(
    ("optimizer_class", "cut"),
    [
        (torch.optim.AdamW, True),
        (torch.optim.SGD, True),
        (torch.optim.Muon, False),
        (torch.optim.Adafactor, False),
        (RowNorm, False),
    ],
)
def test_may_slice_tells_cut_from_whole(optimizer_class, cut) -> None:
    assert may_slice(optimizer_class, {"params": [], "lr": 0.01}, torch.float32) is cut


def test_optimizers_that_mix_parameters_are_refused() -> None:
    with pytest.raises(ConfigError, match="GroupNorm mixes parameters"):
        may_slice(GroupNorm, {"params": [], "lr": 0.1}, torch.float32)


@pytest.mark.parametrize(
    ("optimizer_class", "shape", "expected"),
    [
        (torch.optim.Muon, (300, 70), {"momentum_buffer": ((300, 70), 4)}),
        (torch.optim.Adafactor, (300, 70), {"row_var": ((300, 1), 4), "col_var": ((1, 70), 4)}),
        (torch.optim.Adafactor, (40,), {"variance": ((40,), 4)}),
        (
            torch.optim.Adafactor,
            (4, 9, 6),
            {"row_var": ((4, 9, 1), 4), "col_var": ((4, 1, 6), 4)},
        ),
    ],
)
def test_whole_state_follows_the_parameter_shape(optimizer_class, shape, expected) -> None:
    group = {"params": [], "lr": 0.01}
    assert probe_whole_state(optimizer_class, group, torch.float32, shape) == expected


def test_whole_state_that_cannot_be_sized_is_refused() -> None:
    class Summary(torch.optim.SGD):  # keeps a fixed-size state whatever the parameter
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("hist", torch.zeros(4))
                    p.sub_(p.grad, alpha=group["lr"])

    with pytest.raises(ConfigError, match="'hist' has shape"):
        probe_whole_state(Summary, {"params": [], "lr": 0.1}, torch.float32, (8, 8))
