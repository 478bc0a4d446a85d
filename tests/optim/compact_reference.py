"""The reference loop of the compact-state tests: torch's optimizer on fp32 tensors in memory,
with its moments rounded through the compact format after every step.

Bitwise what ``SwapOptimizer(state_precision=..., master=...)`` computes: the moments of each
parameter go through :class:`~tierswap.optim.formats.MomentFormat` where the optimizer stores
them compact (``compact(name, numel)``: by default every per-element state a format covers),
and the masters of bf16 parameters are cast to them (rounded half up under
``master="remainder"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierswap.optim.formats import MomentFormat, round_half_up_bf16


def inputs(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """``n`` fixed batches of 8 x 128 in ``dtype`` (the test models take 128 features)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 128, generator=gen).to(dtype) for _ in range(n)]


def backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad()
    model(x).float().square().mean().backward()


class CompactReference:
    """``optimizer_class(**kwargs)`` on fp32 masters of ``model``'s parameters, with the state
    named by ``compact`` rounded through ``precision`` after every step."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        kwargs: dict[str, Any],
        precision: str,
        *,
        master: str = "fp32",
        compact: Callable[[str, int], bool] = lambda name, numel: True,
    ) -> None:
        self.model, self.precision, self.master = model, precision, master
        self.compact = compact
        self.low = next(model.parameters()).dtype != torch.float32
        params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in params] if self.low else params
        self.opt = optimizer_class(self.masters, **kwargs)

    @torch.no_grad()
    def round_moments(self) -> None:
        for state in self.opt.state.values():
            for name, value in state.items():
                if not (torch.is_tensor(value) and value.dim() > 0):
                    continue
                if not self.compact(name, value.numel()):
                    continue
                fmt = MomentFormat.for_state(name, value.numel(), self.precision)  # type: ignore[arg-type]
                stored = [
                    torch.empty(a.numel, dtype=a.dtype) for a in fmt.arrays(name, value.numel())
                ]
                fmt.encode(value.reshape(-1), stored)
                fmt.decode(stored, value.view(-1))

    def step(self, x: torch.Tensor) -> None:
        backward(self.model, x)
        if self.low:
            for master, param in zip(self.masters, self.model.parameters(), strict=True):
                master.grad = param.grad.float()
        self.opt.step()
        self.round_moments()
        if self.low:
            with torch.no_grad():
                for master, param in zip(self.masters, self.model.parameters(), strict=True):
                    if self.master == "remainder":
                        param.copy_(round_half_up_bf16(master.contiguous()).view(param.shape))
                    else:
                        param.copy_(master)
