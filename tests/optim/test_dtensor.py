"""DTensor parameters (FSDP2's fully_shard): each rank swaps its local shard.

One process with a world of one on gloo runs FSDP2 on the CPU; the two-rank runs belong to the
distributed tests. The shard is stepped with the same per-element math torch runs on the
DTensor, so the result is bitwise that of the plain optimizer.
"""

from __future__ import annotations

import pytest
import torch

from tests.optim.models import batches, make_models, train_step
from tierswap.optim import SwapOptimizer

dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def world_of_one(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.usefixtures("world_of_one")
def test_fsdp2_local_shards_step_bitwise_like_plain_adamw(tmp_path) -> None:
    from torch.distributed.fsdp import fully_shard

    plain_model, swap_model = make_models()
    for model in (plain_model, swap_model):
        fully_shard(model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    swap = SwapOptimizer(
        swap_model.parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "swap",
        host_budget="16KiB",
    )  # fmt: skip
    with swap:
        assert type(next(swap_model.parameters())).__name__ == "DTensor"
        for x in batches(3):
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        for a, b in zip(plain_model.parameters(), swap_model.parameters(), strict=True):
            assert torch.equal(_full(a), _full(b))
        assert swap.swap_dir == tmp_path / "swap" / "rank-0"
        state = swap.state_dict()["state"]
        for index, ref in plain.state_dict()["state"].items():
            assert type(state[index]["exp_avg"]) is type(ref["exp_avg"])  # DTensor, like torch's
            assert torch.equal(_full(ref["exp_avg"]), _full(state[index]["exp_avg"]))
        # and the state loads back into the plain optimizer
        other = torch.optim.AdamW(swap_model.parameters(), lr=1e-2)
        other.load_state_dict(swap.state_dict())
