"""A streamed parameter's memory: freed between uses, refilled before each. On the CPU large
parameters refill from a pool of page-aligned buffers (:class:`ParameterMemory`): the memory
moves into the parameter's own storage, so that autograd's saved views see it, and back to the
pool when the parameter is freed; the idle buffers stay within the room the stream gives."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.optim.models import assert_same_params
from tierswap.engine import _pool
from tierswap.optim import SwapOptimizer
from tierswap.optim.stream._storage import POOLED_FROM, ParameterMemory, free, nbytes

SIDE = 512  # a SIDE x SIDE fp32 weight is 1 MiB: pooled, and whole pages
assert SIDE * SIDE * 4 >= POOLED_FROM


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the buffers the pool allocates (not reused ones), in order."""
    sizes: list[int] = []
    allocate = _pool.allocate

    def counting(shape: tuple[int, ...], *args: object, **kwargs: object) -> torch.Tensor:
        sizes.append(shape[0])
        return allocate(shape, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_pool, "allocate", counting)
    return sizes


def _freed(shape: tuple[int, ...]) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(shape))
    free(param)
    return param


def test_a_refill_reuses_the_buffer_a_free_gave_back(fresh: list[int]) -> None:
    memory = ParameterMemory()
    param = torch.nn.Parameter(torch.zeros(SIDE, SIDE))
    view = param.detach().t()  # as autograd saves one: a view of the same storage
    free(param)
    (flat,) = memory.allocate([param], room=0)
    flat.fill_(3.0)
    first = param.data_ptr()
    assert first % 4096 == 0
    assert torch.equal(view, torch.full((SIDE, SIDE), 3.0))
    memory.free(param)
    assert param.untyped_storage().nbytes() == 0  # a use now fails loudly
    assert memory.idle == nbytes(param)
    (flat,) = memory.allocate([param], room=0)
    assert param.data_ptr() == first  # the same pages, mapped already
    flat.fill_(5.0)
    assert torch.equal(view, torch.full((SIDE, SIDE), 5.0))  # the view sees the refill
    assert fresh == [nbytes(param)]  # one buffer, allocated once
    memory.free(param)
    memory.trim(0)
    assert memory.idle == 0


def test_idle_buffers_beyond_the_room_are_freed_before_new_memory_is_taken(
    fresh: list[int],
) -> None:
    memory = ParameterMemory()
    big, other = _freed((SIDE, SIDE)), _freed((SIDE, 2 * SIDE))
    memory.allocate([big], room=0)
    memory.free(big)
    assert memory.idle == nbytes(big)
    memory.allocate([other], room=0)  # no idle buffer of its size: big's goes first
    assert memory.idle == 0
    memory.free(other)
    memory.allocate([big], room=nbytes(other))  # big's size is new again; other's stays idle
    assert memory.idle == nbytes(other)
    assert fresh == [nbytes(big), nbytes(other), nbytes(big)]


def test_small_parameters_and_closing_take_memory_of_their_own(fresh: list[int]) -> None:
    memory = ParameterMemory()
    small, big = _freed((8, 8)), _freed((SIDE, SIDE))
    memory.allocate([small, big], room=0, pooled=False)
    for param in (small, big):  # as a model owns its parameters: resizable, exactly its bytes
        storage = param.untyped_storage()
        assert storage.resizable()
        assert storage.nbytes() == nbytes(param)
        memory.free(param)
        assert param.untyped_storage().nbytes() == 0
    memory.allocate([small], room=0)
    assert small.untyped_storage().nbytes() == nbytes(small)  # below POOLED_FROM
    assert fresh == []


def test_a_failed_allocation_gives_the_claimed_buffers_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = ParameterMemory()
    a, b = _freed((SIDE, SIDE)), _freed((SIDE, 2 * SIDE))
    memory.allocate([a], room=0)
    memory.free(a)

    def no_memory(*_: object, **__: object) -> torch.Tensor:
        raise MemoryError("out of memory")

    monkeypatch.setattr(_pool, "allocate", no_memory)
    with pytest.raises(MemoryError):
        memory.allocate([a, b], room=1 << 30)  # a's buffer is claimed, b's allocation fails
    memory.free(a)  # the caller frees those given memory
    memory.free(b)
    assert memory.idle == nbytes(a)  # a's buffer is back; nothing else is held
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes() == 0


class Wide(torch.nn.Module):
    """Linear layers of 1 MiB weights (pooled), one of them checkpointed, and a LayerNorm."""

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
#: other weight's use frees the kept one, whose buffer it reuses.
ONE_KEPT = (1 << 20) + (1 << 16)


@pytest.mark.parametrize("device_budget", [0, ONE_KEPT], ids=["none-kept", "one-kept"])
def test_training_with_pooled_parameters_is_bitwise_torch_adamw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_budget: int
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
    fresh: list[int] = []  # buffers the parameters' pool allocates (none idle to reuse)
    take = memory._pool.take
    monkeypatch.setattr(memory._pool, "take", lambda n: fresh.append(n) or take(n))
    uses: list[int] = []  # refills of the pooled parameters
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
            if device_budget:  # a use frees the kept weight and takes its buffer
                assert len(fresh) < len(uses)
            else:  # nothing stays idle: every use maps new memory
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
