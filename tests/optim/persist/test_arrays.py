"""The first write of the stored arrays: parameters and the masters cast from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tierswap as ts


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_masters_are_cast_into_buffers_that_the_host_budget_counts(
    tmp_path: Path, master: str
) -> None:
    """Construction writes each bf16 parameter's master: cast (or, for a remainder, zeros)
    into pooled buffers reserved in the host ledger, a slice at a time, not into transient
    copies outside it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).to(torch.bfloat16)
    budget = 4 << 20
    opt = ts.SwapOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-3, swap_dir=tmp_path,
        host_budget=budget, master=master,
    )  # fmt: skip
    try:
        host = opt.tier_stats()["host"]
        itemsize = 4 if master == "fp32" else 2  # an fp32 master, or an int16 remainder
        largest = max(  # the masters one slice writes
            sum(seg.stop - seg.start for seg in piece.segments) * itemsize
            for piece in opt._layout.slices
        )
        assert largest <= host["peak"] <= budget  # the casts were in the ledger
        assert host["used"] == 0  # and their buffers went back once written
        store = opt._backend.store  # white-box: what the store holds
        for slot in opt._layout.slots:
            stored = store.get(slot.master_key).view(-1)
            if master == "fp32":
                assert torch.equal(stored, slot.param.detach().float().view(-1))
            else:
                assert not stored.any()
                assert torch.equal(store.get(slot.param_key), slot.param.detach())
    finally:
        opt.close()
