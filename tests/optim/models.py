"""Small models and a lock-step runner shared by the optimizer tests."""

from __future__ import annotations

import copy
import re

import torch

from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer


class TinyNet(torch.nn.Module):
    """Three linear layers and one parameter the loss never uses (its grad stays None)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 24, dtype=dtype)
        self.mid = torch.nn.Linear(24, 24, dtype=dtype)
        self.out = torch.nn.Linear(24, 4, dtype=dtype)
        self.unused = torch.nn.Parameter(torch.randn(5, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def make_models(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[TinyNet, TinyNet]:
    torch.manual_seed(seed)
    model = TinyNet(dtype)
    return model, copy.deepcopy(model)


def groups(model: torch.nn.Module, **second: object) -> list[dict[str, object]]:
    """Weights in one group, biases and the unused param in another with its own settings."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": weights}, {"params": others, **second}]


def batches(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=gen).to(dtype) for _ in range(n)]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


def settled_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """As :func:`train_step`, with a backward that lasts until the slices it handed a
    SwapOptimizer's worker have stepped (as a GPU's backward does; these models' are too
    short): under ``overlap="auto"`` every slice with state then steps speculatively, so what
    a step reads and writes does not depend on the threads' timing."""
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt._stepper.deferred.wait()  # type: ignore[attr-defined]
    opt.step()


def min_host_budget(params: object, optimizer_class: type, **kwargs: object) -> int:
    """The minimum the ConfigError names for a budget of one byte."""
    try:
        SwapOptimizer(params, optimizer_class, host_budget=1, **kwargs).close()
    except ConfigError as exc:
        return int(re.search(r"minimum is .*?\((\d+) bytes\)", str(exc)).group(1))
    raise AssertionError("a one-byte host budget was accepted")


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"{name} differs"


def assert_same_state(plain: dict, swap: dict) -> None:
    assert plain["param_groups"] == swap["param_groups"]
    assert plain["state"].keys() == swap["state"].keys()
    for index, state in plain["state"].items():
        assert state.keys() == swap["state"][index].keys(), index
        for key, value in state.items():
            other = swap["state"][index][key]
            if torch.is_tensor(value):
                assert torch.equal(value.cpu(), other.cpu()), (index, key)
            else:
                assert value == other, (index, key)


def batch_for_step(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The batch of training step ``step``: the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 8, generator=gen).to(dtype)
