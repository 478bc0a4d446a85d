"""A streamed parameter's memory: freed between uses, refilled before each. On the CPU a large
parameter's memory, once freed, stays idle within the room the stream gives
(:class:`ParameterMemory`), and the next parameter of its size takes it back into its own
storage, so that autograd's saved views see it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.optim.models import assert_same_params
from tierswap.optim import SwapOptimizer
from tierswap.optim.stream import _storage
from tierswap.optim.stream._storage import POOLED_FROM, ParameterMemory, idle_room, nbytes

SIDE = 512  # a SIDE x SIDE fp32 weight is 1 MiB: reused, and whole pages
assert SIDE * SIDE * 4 >= POOLED_FROM


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each large parameter given new memory (none idle to reuse), in order."""
    sizes: list[int] = []
    allocate = _storage.allocate

    def counting(param: torch.Tensor) -> torch.Tensor:
        if nbytes(param) >= POOLED_FROM:
            sizes.append(nbytes(param))
        return allocate(param)

    monkeypatch.setattr(_storage, "allocate", counting)
    return sizes


def test_a_refill_takes_back_the_memory_a_free_left_idle(fresh: list[int]) -> None:
    memory = ParameterMemory()
    param = torch.nn.Parameter(torch.zeros(SIDE, SIDE))
    view = param.detach().t()  # as autograd saves one: a view of the same storage
    first = param.data_ptr()
    memory.free(param)
    assert param.untyped_storage().nbytes() == 0  # a use now fails loudly
    assert memory.idle == nbytes(param)
    (flat,) = memory.allocate([param], room=0)
    assert param.data_ptr() == first  # the same pages, mapped already
    assert memory.idle == 0
    flat.fill_(5.0)
    assert torch.equal(view, torch.full((SIDE, SIDE), 5.0))  # the view sees the refill
    memory.free(param)
    memory.trim(0)
    assert memory.idle == 0
    assert fresh == []


def test_idle_memory_beyond_the_room_is_freed_before_new_memory_is_taken(
    fresh: list[int],
) -> None:
    memory = ParameterMemory()
    big = torch.nn.Parameter(torch.zeros(SIDE, SIDE))
    other = torch.nn.Parameter(torch.zeros(SIDE, 2 * SIDE))
    memory.free(big)
    memory.free(other)
    memory.trim(0)
    memory.allocate([big], room=0)  # nothing idle: new memory
    memory.free(big)
    assert memory.idle == nbytes(big)
    memory.allocate([other], room=0)  # no idle memory of its size: big's goes first
    assert memory.idle == 0
    memory.free(other)
    memory.allocate([big], room=nbytes(other))  # big's is gone; other's stays idle
    assert memory.idle == nbytes(other)
    assert fresh == [nbytes(big), nbytes(other), nbytes(big)]


def test_memory_taken_back_is_the_parameters_own_and_only_whole_pages_are_kept(
    fresh: list[int],
) -> None:
    memory = ParameterMemory()
    small = torch.nn.Parameter(torch.zeros(8, 8))
    odd = torch.nn.Parameter(torch.zeros(SIDE * SIDE + 1))  # large, not whole pages
    big = torch.nn.Parameter(torch.zeros(SIDE, SIDE))
    for param in (small, odd, big):
        memory.free(param)
    assert memory.idle == nbytes(big)  # the others: back to the allocator
    memory.allocate([small, odd, big], room=0)
    assert memory.idle == 0  # big took its memory back
    for param in (small, odd, big):  # as a model owns its parameters: resizable, exactly its bytes
        storage = param.untyped_storage()
        assert storage.resizable()
        assert storage.nbytes() == nbytes(param)
    assert fresh == [nbytes(odd)]


def test_memory_another_process_or_numpy_shares_is_not_kept() -> None:
    memory = ParameterMemory()
    shared = torch.nn.Parameter(torch.zeros(SIDE, SIDE))
    shared.share_memory_()
    viewed = torch.nn.Parameter(torch.zeros(SIDE, SIDE))
    array = viewed.detach().numpy()  # a raw view: its memory must not serve another parameter
    for param in (shared, viewed):
        memory.free(param)
        assert param.untyped_storage().nbytes() == 0
    assert memory.idle == 0
    assert array.shape == (SIDE, SIDE)


def test_a_failed_allocation_gives_the_claimed_memory_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = ParameterMemory()
    a, b = torch.nn.Parameter(torch.zeros(SIDE, SIDE)), torch.nn.Parameter(torch.zeros(SIDE))
    memory.free(a)
    memory.free(b)

    def no_memory(param: torch.Tensor) -> torch.Tensor:
        raise MemoryError("out of memory")

    monkeypatch.setattr(_storage, "allocate", no_memory)
    with pytest.raises(MemoryError):
        memory.allocate([b, a], room=1 << 30)  # a's memory is claimed, b's allocation fails
    memory.free(a)  # the caller frees those given memory
    memory.free(b)
    assert memory.idle == nbytes(a)  # a's memory is back; nothing else is held
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes() == 0


class Wide(torch.nn.Module):
    """Linear layers of 1 MiB weights (reused), one of them checkpointed, and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, SIDE)
        self.norm = torch.nn.LayerNorm(SIDE)
        self.mid = torch.nn.Linear(SIDE, SIDE)
        self.deep = torch.nn.Linear(SIDE, SIDE)
        self.out = torch.nn.Linear(SIDE, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.norm(self.inp(x))))
        h = checkpoint(lambda t: torch.tanh(self.deep(t)), h, use_reentrant=False)
        return self.out(h)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad()
    return norm


#: A device budget that keeps one 1 MiB weight and the small parameters between uses: the
#: other weight's use frees the kept one, whose memory it takes.
ONE_KEPT = (1 << 20) + (1 << 16)


@pytest.mark.parametrize("device_budget", [0, ONE_KEPT], ids=["none-kept", "one-kept"])
def test_training_with_reused_memory_is_bitwise_torch_adamw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: list[int], device_budget: int
) -> None:
    torch.manual_seed(0)
    ref = Wide()
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path, host_budget=1 << 20,
        device_budget=device_budget, offload_parameters=True,
    )  # fmt: skip
    memory = opt._stream._memory
    assert opt.tier_stats()["parameters"]["idle_room"] == 0  # a quarter of 1 MiB holds no weight
    assert memory.idle <= device_budget  # the memory the model was built in, freed
    uses: list[int] = []  # refills of the large parameters
    allocate = memory.allocate

    def counting(params: list[torch.Tensor], **kwargs: object) -> list[torch.Tensor]:
        uses.extend(nbytes(p) for p in params if nbytes(p) >= POOLED_FROM)
        return allocate(params, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(memory, "allocate", counting)
    weight = nbytes(model.mid.weight)
    for step in range(4):
        fresh.clear()
        uses.clear()
        assert torch.equal(_step(ref, plain, step), _step(model, opt, step))
        stats = opt.tier_stats()["parameters"]
        assert memory.idle + stats["live_bytes"] <= device_budget  # the budget holds both
        assert model.mid.weight.untyped_storage().nbytes() in (0, weight)
        if step:  # mid and deep in forward, again in backward (deep's recomputation and
            assert len(uses) >= (4 if not device_budget else 2)  # backward share a use)
            if device_budget:  # a use frees the kept weight and takes its memory
                assert len(fresh) < len(uses)
            else:  # nothing stays idle: every use takes new memory
                assert len(fresh) == len(uses)
    opt.close()
    assert_same_params(ref, model)
    for param in model.parameters():  # the model owns its memory again: it streams anew
        assert param.untyped_storage().nbytes() == nbytes(param)
    again = SwapOptimizer(
        model, torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "again", host_budget=1 << 20,
        offload_parameters=True,
    )  # fmt: skip
    _step(model, again, 0)
    again.close()


def test_the_idle_room_is_a_quarter_of_the_host_budget_at_most_where_parameters_refill() -> None:
    mib = 1 << 20
    sizes = [4 * mib, 4 * mib, 2 * mib, 4096]  # the last is too small to be reused
    assert idle_room(sizes, host_budget=64 * mib, kept=0) == 10 * mib  # all of them fit
    assert idle_room(sizes, host_budget=16 * mib, kept=0) == 4 * mib  # a quarter
    assert idle_room(sizes, host_budget=64 * mib, kept=6 * mib) == 4 * mib  # the rest refills
    assert idle_room(sizes, host_budget=64 * mib, kept=10 * mib) == 0  # the budget keeps all
    assert idle_room(sizes, host_budget=4 * mib, kept=0) == 0  # 1 MiB holds none of them
    assert idle_room([mib + 1], host_budget=64 * mib, kept=0) == 0  # not whole pages


def test_a_share_of_the_host_budget_keeps_freed_memory_for_the_next_uses(
    tmp_path: Path, fresh: list[int]
) -> None:
    """Without ``device_budget`` the weights' memory stays idle in a share of ``host_budget``
    (the layout plans the rest): after the memory the model was built in, no use takes new
    memory, and training stays bitwise torch's."""
    torch.manual_seed(0)
    ref = Wide()
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    host = 16 << 20
    opt = SwapOptimizer(
        model, torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path, host_budget=host,
        offload_parameters=True,
    )  # fmt: skip
    weights = nbytes(model.mid.weight) + nbytes(model.deep.weight)
    assert opt.tier_stats()["parameters"]["idle_room"] == weights  # under a quarter: both
    assert opt.host_budget == host - weights  # what the layout and the pipeline hold
    for step in range(4):
        fresh.clear()
        assert torch.equal(_step(ref, plain, step), _step(model, opt, step))
        stats = opt.tier_stats()["parameters"]
        assert 0 < stats["idle_bytes"] <= weights
        assert stats["live_bytes"] == 0
        assert fresh == []  # every use took memory a free left idle
    assert opt.tier_stats()["host"]["used"] <= opt.host_budget
    opt.close()
    assert_same_params(ref, model)
    for param in model.parameters():
        assert param.untyped_storage().nbytes() == nbytes(param)
