"""Inputs the compact-format tests share (test_formats, test_native): Adam-like moments and
the upper halves of fp32 masters where the remainders' rounding has its edge cases."""

from __future__ import annotations

import torch


def moments(numel: int, *, signed: bool, seed: int = 0) -> torch.Tensor:
    """Values spread over ten decades, as Adam's moments are (squared for the second moment)."""
    gen = torch.Generator().manual_seed(seed)
    decades = torch.empty(numel).uniform_(-8, 1, generator=gen)
    x = torch.randn(numel, generator=gen) * torch.pow(10.0, decades)
    return x if signed else x * x


#: Upper halves: zero, subnormals, the smallest normal, 1.0, the largest bf16s, inf, both signs.
HIGHS = (0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80)
HIGHS += tuple(h | 0x8000 for h in HIGHS)
