"""The layout: how much of the budgets resident slices fill, and what streams."""

from __future__ import annotations

import pytest
import torch

from tierswap.optim.plan import _layout
from tierswap.optim.plan._partition import Slot, master_dtype

FLOOR = 8 << 20  # STREAM_FLOOR (32 MiB) scaled as a 134 MB budget to a 32 MiB one


def _slots(count: int = 8, numel: int = 1 << 20) -> list[Slot]:
    """``count`` fp32 parameters of ``numel`` elements with AdamW's two fp32 moments."""
    params = [torch.zeros(numel) for _ in range(count)]
    return [Slot(i, p, 0, master_dtype(p) != p.dtype, (4, 4)) for i, p in enumerate(params)]


def _resident_bytes(layout: _layout.Layout) -> int:
    return sum(piece.held_bytes for piece in layout.slices if piece.index in layout.placement)


def _state(slots: list[Slot]) -> int:
    whole = _layout.plan_layout(slots, host_budget=None, device_budget=0, policy="lookahead")
    return sum(piece.held_bytes for piece in whole.slices)


@pytest.mark.parametrize(("host", "device"), [(0.5, 0.0), (0.25, 0.25), (0.75, 0.0)])
def test_resident_slices_fill_nine_tenths_of_budgets_that_hold_much_of_the_state(
    monkeypatch: pytest.MonkeyPatch, host: float, device: float
) -> None:
    monkeypatch.setattr(_layout, "STREAM_FLOOR", FLOOR)
    slots = _slots()
    state = _state(slots)
    budgets = int((host + device) * state)
    layout = _layout.plan_layout(
        slots, host_budget=int(host * state), device_budget=int(device * state),
        policy="lookahead",
    )  # fmt: skip
    streamed = state - _resident_bytes(layout)
    assert streamed <= 1.05 * (state - 0.9 * budgets), (streamed / state, host, device)


def test_budgets_small_against_the_state_keep_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the budget holds little of the state, slices stay a floor's quarter: large enough
    for the disk, though a quarter of the budget then streams."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", FLOOR)
    slots = _slots()
    state = _state(slots)
    budget = state // 8
    layout = _layout.plan_layout(slots, host_budget=budget, device_budget=0, policy="lookahead")
    assert max(piece.held_bytes for piece in layout.slices) >= FLOOR // 8
    assert _resident_bytes(layout) <= budget - FLOOR


def test_budgets_small_against_the_state_raise_the_floor_within_the_traffic_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the budget holds under a fifth of the state, the streaming part grows past the
    floor to what keeps the traffic within 1.05 x (state - 0.9 x budget), up to the ceiling:
    larger slices, fewer of them, still within the bound."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", 1 << 20)
    slots = _slots()
    state = _state(slots)
    budget = state // 10

    def plan(ceiling: int) -> _layout.Layout:
        monkeypatch.setattr(_layout, "STREAM_CEILING", ceiling)
        return _layout.plan_layout(slots, host_budget=budget, device_budget=0, policy="lookahead")

    kept, raised = plan(1 << 20), plan(64 << 20)  # a ceiling at the floor keeps the floor
    allowed = (state // 20 + budget * 55 // 1000) * 4 // 5
    assert allowed > 2 * (1 << 20)
    assert len(raised.slices) * 2 <= len(kept.slices)
    assert _resident_bytes(raised) <= budget - allowed + max(p.held_bytes for p in raised.slices)
    streamed = state - _resident_bytes(raised)
    assert streamed <= 1.05 * (state - 0.9 * budget), streamed / state
    assert streamed > state - _resident_bytes(kept)  # the bytes that bought the larger slices


@pytest.mark.parametrize("share", [1.0, 0.8])
def test_a_gpu_budget_that_holds_the_state_keeps_every_slice(share: float) -> None:
    """Slices that step on a GPU pass through its memory when they stream, so the device tier
    reserves room for three of them beside the resident ones; a device budget that holds all
    the slices' working sets reserves none: every slice stays there (below that, some stream;
    here, four slices of a quarter each, none stays)."""
    slots = _slots()
    state = _state(slots)
    layout = _layout.plan_layout(
        slots, host_budget=state // 4, device_budget=int(share * 1.01 * state),
        policy="lookahead", device_compute=True,
    )  # fmt: skip
    on_device = [piece for piece in layout.slices if layout.placement.get(piece.index) == "device"]
    assert (len(on_device) == len(layout.slices)) == (share == 1.0)


def _longest_run(flags: list[bool], value: bool) -> int:
    longest = run = 0
    for flag in flags:
        run = run + 1 if flag == value else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize(("host", "device"), [(0.5, 0.0), (0.25, 0.25), (0.2, 0.0)])
def test_resident_slices_spread_over_the_order_slices_step_in(
    monkeypatch: pytest.MonkeyPatch, host: float, device: float
) -> None:
    """Belady on the cyclic schedule keeps the slices that step first; where every slice
    steps in backward (which the step cannot reorder), the layout spreads the same bytes over
    that order, each tier's within its share, so that the disk never idles through a run of
    resident slices. Elsewhere the policy's choice stands (``step()`` interleaves the slices;
    under ``"auto"`` a resident slice waits for it, keeping its parameter's gradient)."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", FLOOR)
    slots = _slots(16)
    state = _state(slots)
    budgets = {"host_budget": int(host * state), "device_budget": int(device * state)}
    layout = _layout.plan_layout(slots, policy="lookahead", in_backward=True, **budgets)
    after_backward = _layout.plan_layout(slots, policy="lookahead", **budgets)
    monkeypatch.setattr(_layout, "_spread", lambda order, placement, *_: placement)
    prefix = _layout.plan_layout(slots, policy="lookahead", in_backward=True, **budgets)
    assert after_backward.placement == prefix.placement  # the policy's, as it chose
    resident = [piece.index in layout.placement for piece in layout.slices]
    assert _longest_run([p.index in prefix.placement for p in prefix.slices], True) > 4
    kept, streamed = resident.count(True), resident.count(False)
    assert _longest_run(resident, True) <= -(-kept // streamed) + 1
    assert _longest_run(resident, False) <= -(-streamed // kept) + 1
    largest = max(piece.held_bytes for piece in layout.slices)
    for tier in ("device", "host"):
        spread, policy = (
            sum(p.held_bytes for p in x.slices if x.placement.get(p.index) == tier)
            for x in (layout, prefix)
        )
        assert policy - largest <= spread <= policy


def test_a_device_tier_in_ram_widens_the_streaming_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device tier is RAM (slices step on the CPU), the slices in flight get a
    tenth of both budgets, not of the host budget alone: beside a device tier that holds most
    of the resident state, a tenth of the host budget left the disk too few slices in flight."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", FLOOR)
    slots = _slots(16)
    state = _state(slots)
    host, device = state // 10, state // 3
    layout = _layout.plan_layout(slots, host_budget=host, device_budget=device, policy="lookahead")
    on_host = sum(p.held_bytes for p in layout.slices if layout.placement.get(p.index) == "host")
    assert 0 < on_host <= host - (host + device) // 10
