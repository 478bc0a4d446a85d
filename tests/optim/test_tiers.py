"""Three real tiers for the optimizer: the policy places slices in the device tier, in host
memory or on disk; every placement steps bitwise like torch, and tier_stats() says what each
tier holds and serves."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.engine.policies import KeepEven
from tests.optim.models import assert_same_params, assert_same_state
from tierswap.engine import LookaheadPolicy, LRUPolicy
from tierswap.optim import SwapOptimizer
from tierswap.optim.plan import _layout

LAYERS = 8


@pytest.fixture(autouse=True)
def small_stream(monkeypatch) -> None:
    """Budgets of tests are KiB: stream a tenth of them, not the 32 MiB floor of real runs."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", 16 << 10)


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


STATE = LAYERS * (64 * 64 + 64) * 8  # AdamW's two fp32 moments
PLACEMENTS = {
    # name: (host_budget, device_budget)
    "all-device": ("64KiB", 2 * STATE),
    "device+host+nvme": (STATE // 2, STATE // 4),
    "all-nvme": ("64KiB", 0),
}


def _run(model, opt, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()


@pytest.mark.parametrize("policy", ["lookahead", "lru", "custom"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_and_policy_is_bitwise(placement, policy, tmp_path) -> None:
    host, device = PLACEMENTS[placement]
    torch.manual_seed(0)
    ref_model, model = Stack(), Stack()
    model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2)
    chosen = KeepEven() if policy == "custom" else policy
    opt = SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "run",
        host_budget=host, device_budget=device, policy=chosen, commit_every=0,
    )  # fmt: skip
    with opt:
        _run(ref_model, ref)
        _run(model, opt)
        assert_same_params(ref_model, model)
        stats = opt.tier_stats()
        assert_same_state(ref.state_dict(), opt.state_dict())
        tiers = set(opt.placement.values())
        if placement == "all-device":
            assert tiers == {"device"}
            assert stats["device"]["used"] > 0
            assert stats["device"]["hits"] == 2 * len(opt.slices)  # steps 2 and 3
            assert stats["host"]["misses"] == len(opt.slices)  # the first step made the state
            assert stats["nvme"]["bytes_read"] == 0
        if placement == "device+host+nvme" and policy != "lru":
            assert tiers == {"device", "host"}
            assert stats["device"]["hits"] > 0
            assert stats["host"]["hits"] > 0
            assert stats["host"]["misses"] > 0  # the rest streams
        if policy == "lru" and placement != "all-device":
            assert not opt.placement  # LRU keeps nothing of a cycle larger than the tier
        if policy == "custom":
            assert all(index % 2 == 0 for index in opt.placement) or placement == "all-device"
        for tier in ("device", "host"):
            assert 0 <= stats[tier]["used"] <= stats[tier]["budget"]


def test_resident_slices_are_written_at_commits_only(tmp_path) -> None:
    """With commit_every=N the resident share is not written between commits."""
    torch.manual_seed(0)
    model = Stack()
    # overlap=None: speculation would also write the streamed parameters' pre-step copies
    opt = SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "run",
        host_budget=STATE // 2, commit_every=4, overlap=None,
    )  # fmt: skip
    with opt:
        _run(model, opt, steps=1)  # the first step creates the state
        opt.synchronize()
        before = opt.tier_stats()["nvme"]["bytes_written"]
        _run(model, opt, steps=2)  # no commit due
        opt.synchronize()
        written = opt.tier_stats()["nvme"]["bytes_written"] - before
        streamed = [p for p in opt.slices if p.index not in opt.placement]
        assert opt.placement
        assert streamed
        state_of = {p.index: sum(s.numel * 8 for s in p.segments) for p in opt.slices}
        assert written == 2 * sum(state_of[p.index] for p in streamed)


def test_an_lru_instance_is_used_not_its_name(tmp_path) -> None:
    class Counting(LRUPolicy):
        calls = 0

        def victim(self, candidates, incoming):
            Counting.calls += 1
            return super().victim(candidates, incoming)

    model = Stack()
    with SwapOptimizer(
        model.parameters(), swap_dir=tmp_path / "run", host_budget=STATE // 2, policy=Counting()
    ):
        assert Counting.calls > 0


def test_a_lookahead_instance_places_as_the_name_does(tmp_path) -> None:
    """Each tier replays its own copy of a policy instance (one instance shared by the device
    and host replays kept fewer slices), and the caller's instance stays untouched."""
    host, device = PLACEMENTS["device+host+nvme"]
    mine = LookaheadPolicy()
    placements = []
    for name, policy in (("name", "lookahead"), ("instance", mine)):
        model = Stack()
        with SwapOptimizer(
            model.parameters(), swap_dir=tmp_path / name, host_budget=host, device_budget=device,
            policy=policy,
        ) as opt:  # fmt: skip
            placements.append(dict(opt.placement))
    assert placements[0] == placements[1]
    assert set(placements[0].values()) == {"device", "host"}
    assert mine.schedule is None


def test_load_snapshot_keeps_the_tiers(tmp_path) -> None:
    """The backend reopens itself on the snapshot with the same budgets: the device tier still
    holds its slices after the reload, and training goes on bitwise."""
    host, device = PLACEMENTS["device+host+nvme"]
    torch.manual_seed(0)
    ref_model, model = Stack(), Stack()
    model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "run",
        host_budget=host, device_budget=device, commit_every=0,
    )  # fmt: skip
    with opt:
        _run(ref_model, ref, steps=2)
        _run(model, opt, steps=2)
        opt.snapshot(tmp_path / "snap")
        _run(model, opt, steps=1)  # moves on past the snapshot, then goes back to it
        opt.load_snapshot(tmp_path / "snap")
        assert opt.steps == 2
        _run(ref_model, ref, steps=2)
        _run(model, opt, steps=2)
        assert_same_params(ref_model, model)
        stats = opt.tier_stats()
        assert stats["device"]["budget"] == device
        assert stats["device"]["used"] > 0
        assert stats["device"]["hits"] > 0


def test_resident_slices_step_spread_among_streamed_ones() -> None:
    """The step order mixes resident slices (no disk) evenly into the streamed ones, keeping
    each kind in its order, so reads of streamed slices proceed while resident ones step."""

    class Piece:
        def __init__(self, index: int) -> None:
            self.index = index

    pieces = [Piece(i) for i in range(10)]
    placement = dict.fromkeys(range(7), "host")  # a resident prefix, as lookahead keeps
    order = [p.index for p in _layout.interleave(pieces, placement)]
    assert sorted(order) == list(range(10))
    assert [i for i in order if i in placement] == list(range(7))
    assert [i for i in order if i not in placement] == [7, 8, 9]
    assert order[0] == 7  # a streamed slice first: its read started during backward
    gaps = [order.index(i) for i in (7, 8, 9)]
    assert max(b - a for a, b in itertools.pairwise(gaps)) <= 4  # no long run without the disk
    assert [p.index for p in _layout.interleave(pieces, {})] == list(range(10))
