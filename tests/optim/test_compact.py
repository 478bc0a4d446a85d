"""Compact state (issue 17 parts 1-2): bf16 and 8-bit moments, bf16 master remainders.

Each swapped run is compared bitwise with a reference loop: torch's optimizer on fp32 tensors in
memory that, after every step, encodes and decodes its moments with :mod:`tierswap.optim.
formats` as the optimizer stores them, and keeps fp32 masters whose bf16 parameter is cast
half up (``round_half_up_bf16``) under ``master="remainder"``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.optim.compact_reference import CompactReference, backward, inputs
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer
from tierswap.optim.formats import MomentFormat, join
from tierswap.optim.plan import _layout
from tierswap.optim.plan._partition import Segment

#: Inner optimizers and their keywords: moments of both signs, an amsgrad maximum, a momentum.
CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
#: Everything streams; the large weight spans several slices. One slice holds at least a chunk
#: of every array: 16 KiB of 8-bit codes are 16384 elements, with a bf16 parameter's master
#: remainder (and its scratch) 360 KiB.
BUDGETS = {torch.float32: "256KiB", torch.bfloat16: "320KiB"}


class Net(torch.nn.Module):
    """A weight of 32768 elements (8-bit, cut by slices) beside small fp32-state ones."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(128, 256)  # weight 8-bit, bias (256) stays fp32
        self.head = torch.nn.Linear(256, 8, bias=False)  # 2048 elements: fp32 under 8bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.big(x)))


class Wide(torch.nn.Module):
    """Only large weights, so every moment is compact (the byte counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(128, 256, bias=False)
        self.b = torch.nn.Linear(256, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def Reference(  # noqa: N802 (reads as the class it makes)
    model: torch.nn.Module, name: str, precision: str, master: str = "fp32"
) -> CompactReference:
    """The reference loop for the optimizer ``CASES[name]``."""
    optimizer_class, kwargs = CASES[name]
    return CompactReference(model, optimizer_class, kwargs, precision, master=master)


def _pair(dtype: torch.dtype, model_class: type[torch.nn.Module] = Net) -> tuple[Any, Any]:
    torch.manual_seed(0)
    plain = model_class().to(dtype)
    return plain, copy.deepcopy(plain)


def _swap(model: torch.nn.Module, name: str, **settings: Any) -> SwapOptimizer:
    optimizer_class, kwargs = CASES[name]
    settings.setdefault("host_budget", BUDGETS[next(model.parameters()).dtype])
    return SwapOptimizer(model.parameters(), optimizer_class, **settings, **kwargs)


def _swap_step(model: torch.nn.Module, swap: SwapOptimizer, x: torch.Tensor) -> None:
    backward(model, x)
    swap.step()


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"{name} differs"


def _assert_state_equal(reference: CompactReference, swap: SwapOptimizer) -> None:
    saved = swap.state_dict()["state"]
    for index, master in enumerate(reference.masters):
        for key, value in reference.opt.state[master].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved[index][key])), (
                index,
                key,
            )


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_moments_equal_a_rounded_reference_bitwise(
    name: str, precision: str, dtype: torch.dtype
) -> None:
    plain, swapped = _pair(dtype)
    reference = Reference(plain, name, precision)
    with _swap(swapped, name, state_precision=precision) as swap:
        big = swapped.big.weight
        cuts = [seg for s in swap.slices for seg in s.segments if seg.slot.param is big]
        whole = Segment(cuts[0].slot, 0, big.numel())
        assert len(cuts) > 1 or whole.working_set <= swap.host_budget
        for x in inputs(4, dtype):
            reference.step(x)
            _swap_step(swapped, swap, x)
            _assert_same(plain, swapped)
        _assert_state_equal(reference, swap)


def test_8bit_slices_cut_at_block_boundaries_and_store_codes_and_scales() -> None:
    _, model = _pair(torch.float32)
    with _swap(model, "adamw", state_precision="8bit") as swap:
        _swap_step(model, swap, inputs(1, torch.float32)[0])
        for piece in swap.slices:
            for seg in piece.segments:
                if seg.slot.stored_precision == "8bit":
                    assert seg.start % 256 == 0
                    assert seg.stop % 256 == 0 or seg.stop == seg.slot.local.numel()
        store = swap._backend.store
        keys = set(store.keys())
        assert {"p0/exp_avg.codes", "p0/exp_avg.absmax", "p0/exp_avg_sq.codes"} <= keys
        assert store.info("p0/exp_avg.codes").dtype == torch.uint8
        assert tuple(store.info("p0/exp_avg_sq.absmax").shape) == (32768 // 256,)
        assert store.info("p1/exp_avg").dtype == torch.float32  # the bias: under 4096
        assert store.info("p2/exp_avg").dtype == torch.float32


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
def test_remainder_masters_equal_fp32_masters_cast_half_up(precision: str) -> None:
    plain, swapped = _pair(torch.bfloat16)
    reference = Reference(plain, "adamw", precision, master="remainder")
    with _swap(swapped, "adamw", state_precision=precision, master="remainder") as swap:
        assert not any(k.endswith("/master") for k in swap._backend.store.keys())  # noqa: SIM118 (a list)
        for x in inputs(4, torch.bfloat16):
            reference.step(x)
            _swap_step(swapped, swap, x)
            _assert_same(plain, swapped)
        swap._backend.pipeline.flush()
        for slot, master in zip(swap._layout.slots, reference.masters, strict=True):
            remainder = swap._backend.read(slot.master_key).view(torch.int16)
            rebuilt = join(slot.param.detach().reshape(-1), remainder.reshape(-1))
            assert torch.equal(rebuilt, master.reshape(-1)), slot.prefix


def test_master_remainder_is_ignored_for_fp32_parameters() -> None:
    plain, swapped = _pair(torch.float32)
    reference = Reference(plain, "adamw", "fp32")
    with _swap(swapped, "adamw", master="remainder") as swap:
        for x in inputs(2, torch.float32):
            reference.step(x)
            _swap_step(swapped, swap, x)
        _assert_same(plain, swapped)
        assert not any("remainder" in k for k in swap._backend.store.keys())  # noqa: SIM118 (a list)


def _bytes_per_step(
    model: torch.nn.Module, xs: list[torch.Tensor], tmp_path: Any, **settings: Any
) -> list[tuple[float, float]]:
    """Bytes read and written per parameter in each of the two steps after the first (which
    creates the state), everything streamed, no commit due (a due commit adds the committed
    copies of the parameters)."""
    numel = sum(p.numel() for p in model.parameters())
    # overlap=None: the format's bytes alone (a speculative step also writes the pre-step
    # copies of parameters the store keeps: tests/optim/test_streaming.py counts those)
    settings = {"swap_dir": tmp_path / "s", "commit_every": 0, "overlap": None, **settings}
    per_step = []
    with _swap(model, "adamw", **settings) as swap:
        assert not swap.placement, "a slice stayed resident"
        for step, x in enumerate(xs):
            before = swap.tier_stats()["nvme"]
            _swap_step(model, swap, x)
            swap._backend.pipeline.drain()
            after = swap.tier_stats()["nvme"]
            if step:
                moved = [after[k] - before[k] for k in ("bytes_read", "bytes_written")]
                per_step.append((moved[0] / numel, moved[1] / numel))
        assert swap.tier_stats()["host"]["used"] <= swap.tier_stats()["host"]["budget"]
    return per_step


#: 8-bit moments of two states: codes, and one fp32 scale per block of 256.
CODES, SCALES = 2.0, 2 * 4 / 256


@pytest.mark.parametrize(
    ("dtype", "settings", "expected"),
    [
        (torch.float32, {}, 8.0),
        (torch.float32, {"state_precision": "bf16"}, 4.0),
        (torch.float32, {"state_precision": "8bit"}, CODES),
        (torch.bfloat16, {}, 12.0),
        (torch.bfloat16, {"master": "remainder"}, 10.0),
        (torch.bfloat16, {"master": "remainder", "state_precision": "bf16"}, 6.0),
        (torch.bfloat16, {"master": "remainder", "state_precision": "8bit"}, 2 + CODES),
    ],
)
def test_bytes_read_and_written_per_parameter_per_step(
    dtype: torch.dtype, settings: dict[str, Any], expected: float, tmp_path: Any
) -> None:
    """Each stored byte is read and written once per steady step. Slices here are smaller
    than what a page of 8-bit scales covers (262,144 elements), so the layout holds the
    scales in host memory (``Layout.held_scales``): read once (in the second step, the first
    with state to read), written by commits, not by steps."""
    _, model = _pair(dtype, Wide)
    second, steady = _bytes_per_step(model, inputs(3, dtype), tmp_path, **settings)
    assert steady == (expected, expected), steady
    scales = SCALES if settings.get("state_precision") == "8bit" else 0.0
    assert second == (expected + scales, expected), second


class Mlp(torch.nn.Module):
    """1.3M parameters (issue 28): three weights of 8-bit moments (16384 to 1M elements)
    beside biases that keep fp32 moments."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 1024)
        self.b = torch.nn.Linear(1024, 1024)
        self.c = torch.nn.Linear(1024, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_8bit_reads_at_a_small_budget_stay_near_the_format(tmp_path: Any) -> None:
    """At a 1 MiB budget slices hold 32768 elements, an eighth of a page of scales: a steady
    step reads and writes the codes and the biases' fp32 moments only, within 2.1 bytes per
    parameter (2 * (1 + 4/256) = 2.03 is the format's size), the budget honoured."""
    plain, swapped = _pair(torch.float32, Mlp)
    numel = sum(p.numel() for p in plain.parameters())
    biases = sum(m.bias.numel() for m in (plain.a, plain.b, plain.c))
    floor = (CODES * (numel - biases) + 8 * biases) / numel
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 256, generator=gen) for _ in range(3)]
    settings = {"state_precision": "8bit", "host_budget": "1MiB"}
    with _swap(copy.deepcopy(plain), "adamw", **settings) as swap:
        layout = swap._layout
        assert 0 < layout.held_scales <= layout.host_budget // 8
        assert max(seg.numel for piece in layout.slices for seg in piece.segments) < 1 << 18
    _second, steady = _bytes_per_step(swapped, xs, tmp_path, **settings)
    assert steady == pytest.approx((floor, floor), abs=1e-9)
    assert steady[0] <= 2.1
    reference = Reference(plain, "adamw", "8bit")
    for x in xs:
        reference.step(x)
    _assert_same(plain, swapped)


class Large(torch.nn.Module):
    """2M elements in two weights: with a 16 MiB budget everything streams and 8-bit codes
    get 256 KiB chunks, from which a scales chunk covers exactly one codes chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(1024, 1024, bias=False)
        self.b = torch.nn.Linear(1024, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_8bit_scales_have_chunks_of_their_own_read_and_written_whole(tmp_path: Any) -> None:
    model = Large()
    numel = sum(p.numel() for p in model.parameters())
    settings = {"swap_dir": tmp_path / "s", "commit_every": 0, "host_budget": "16MiB"}
    with _swap(model, "adamw", state_precision="8bit", **settings) as swap:
        assert not swap.placement, "a slice stayed resident"
        store = swap._backend.store
        traffic = []
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            before = swap.tier_stats()["nvme"]
            swap.step()
            swap.synchronize()
            after = swap.tier_stats()["nvme"]
            traffic.append(
                [(after[k] - before[k]) / numel for k in ("bytes_read", "bytes_written")]
            )
        codes = store.info("p0/exp_avg.codes").chunk_bytes
        assert codes >= 256 << 10
        assert store.info("p0/exp_avg.absmax").chunk_bytes == codes * 4 // 256
        assert store.info("p0/exp_avg_sq.absmax").chunk_bytes == codes * 4 // 256
    # the codes of two moments, exactly; the scales are held in host memory (a 64 KiB
    # page each, read once: the second step reads them) and written by commits
    assert traffic[-1] == [CODES] * 2
    assert traffic[1] == [CODES + SCALES, CODES]


def test_resume_keeps_a_folders_scale_chunking(tmp_path: Any, monkeypatch: Any) -> None:
    """A folder whose 8-bit scales share the codes' chunk size (as written before scales had
    chunks of their own) resumes, steps bitwise and keeps its chunking."""
    import tierswap.optim.step._slice_work as slice_step

    plain, swapped = _pair(torch.float32, Large)
    reference = Reference(plain, "adamw", "8bit")
    settings = {"state_precision": "8bit", "swap_dir": tmp_path / "s", "host_budget": "16MiB"}
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 1024, generator=gen) for _ in range(4)]
    with monkeypatch.context() as patch:
        patch.setattr(slice_step, "array_chunk_bytes", lambda array, chunk_bytes: None)
        with _swap(swapped, "adamw", **settings) as swap:
            for x in xs[:2]:
                reference.step(x)
                _swap_step(swapped, swap, x)
            shared = swap._backend.store.info("p0/exp_avg.absmax").chunk_bytes
    assert shared > 4096  # (1M / 256) * 4 bytes in one chunk, not the page the scales get now
    with _swap(swapped, "adamw", resume=True, **settings) as swap:
        assert swap._backend.store.info("p0/exp_avg.absmax").chunk_bytes == shared
        for x in xs[2:]:
            reference.step(x)
            _swap_step(swapped, swap, x)
        _assert_same(plain, swapped)
        _assert_state_equal(reference, swap)


def test_resume_after_close_continues_bitwise(tmp_path: Any) -> None:
    plain, swapped = _pair(torch.bfloat16)
    reference = Reference(plain, "adamw", "8bit", master="remainder")
    settings = {"state_precision": "8bit", "master": "remainder", "swap_dir": tmp_path / "s"}
    xs = inputs(5, torch.bfloat16)
    with _swap(swapped, "adamw", **settings) as swap:
        for x in xs[:3]:
            reference.step(x)
            _swap_step(swapped, swap, x)
    resumed_model = copy.deepcopy(plain)
    with torch.no_grad():
        for p in resumed_model.parameters():
            p.zero_()  # the resume restores the parameters
    with _swap(resumed_model, "adamw", resume=True, **settings) as swap:
        assert swap.steps == 3
        meta = swap._backend.committed_meta()
        assert meta is not None
        assert (meta["state_precision"], meta["master"]) == ("8bit", "remainder")
        _assert_same(plain, resumed_model)
        for x in xs[3:]:
            reference.step(x)
            _swap_step(resumed_model, swap, x)
        _assert_same(plain, resumed_model)
        _assert_state_equal(reference, swap)


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ({"state_precision": "8bit"}, {"state_precision": "bf16"}),
        ({}, {"state_precision": "8bit"}),
        ({"master": "remainder"}, {}),
    ],
)
def test_resume_with_another_format_is_refused_and_writes_nothing(
    first: dict[str, Any], then: dict[str, Any], tmp_path: Any
) -> None:
    _, model = _pair(torch.bfloat16)
    folder = tmp_path / "s"
    with _swap(model, "adamw", swap_dir=folder, **first) as swap:
        _swap_step(model, swap, inputs(1, torch.bfloat16)[0])
    files = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    (setting,) = (then.keys() | first.keys()) - {k for k in first if first[k] == then.get(k)}
    with pytest.raises(ConfigError, match=setting) as caught:
        _swap(model, "adamw", swap_dir=folder, resume=True, **then)
    theirs, ours = first.get(setting, "fp32"), then.get(setting, "fp32")
    assert repr(theirs) in str(caught.value)
    assert repr(ours) in str(caught.value)
    after = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    assert {p: t for p, t in after.items() if "lock" not in p.name} == {
        p: t for p, t in files.items() if "lock" not in p.name
    }


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_state_dict_round_trip_decodes_and_encodes(precision: str) -> None:
    plain, swapped = _pair(torch.bfloat16)
    reference = Reference(plain, "adamw", precision, master="remainder")
    with _swap(swapped, "adamw", state_precision=precision, master="remainder") as swap:
        for x in inputs(2, torch.bfloat16):
            reference.step(x)
            _swap_step(swapped, swap, x)
        saved = swap.state_dict()
        assert all(
            v.dtype == torch.float32
            for state in saved["state"].values()
            for v in state.values()
            if v.dim()
        )
        assert saved["state"][0]["exp_avg"].shape == swapped.big.weight.shape
    # into a new optimizer: load_state_dict encodes the fp32 state once more (bf16 values are
    # on its grid already; an 8-bit block whose largest magnitude is negative may requantise),
    # and the master restarts from the parameter (remainder 0): so does the reference
    other = copy.deepcopy(swapped)
    with _swap(other, "adamw", state_precision=precision, master="remainder") as swap:
        swap.load_state_dict(saved)
        with torch.no_grad():
            for index, master in enumerate(reference.masters):
                for key, value in reference.opt.state[master].items():
                    value.copy_(saved["state"][index][key])
            reference.round_moments()
            for master, param in zip(reference.masters, plain.parameters(), strict=True):
                master.copy_(param)
        _assert_state_equal(reference, swap)
        if precision == "bf16":
            again = swap.state_dict()["state"]
            assert all(
                torch.equal(v, again[i][k])
                for i, st in saved["state"].items()
                for k, v in st.items()
            )
        for x in inputs(2, torch.bfloat16):
            reference.step(x)
            _swap_step(other, swap, x)
        _assert_same(plain, other)
        _assert_state_equal(reference, swap)


def test_fp32_state_dict_loads_into_8bit_rounded_once() -> None:
    plain, swapped = _pair(torch.float32)
    fp32 = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x in inputs(2, torch.float32):
        backward(plain, x)
        fp32.step()
    saved = fp32.state_dict()
    with _swap(swapped, "adamw", state_precision="8bit") as swap:
        swap.load_state_dict(saved)
        loaded = swap.state_dict()["state"][0]["exp_avg"]
    fmt = MomentFormat.for_state("exp_avg", loaded.numel(), "8bit")
    stored = [torch.empty(a.numel, dtype=a.dtype) for a in fmt.arrays("exp_avg", loaded.numel())]
    fmt.encode(saved["state"][0]["exp_avg"].reshape(-1).contiguous(), stored)
    assert torch.equal(loaded.reshape(-1), fmt.decode(stored, torch.empty(loaded.numel())))


def test_snapshot_keeps_the_format_and_resumes_from_it(tmp_path: Any) -> None:
    plain, swapped = _pair(torch.bfloat16)
    reference = Reference(plain, "adamw", "bf16", master="remainder")
    settings = {"state_precision": "bf16", "master": "remainder"}
    xs = inputs(4, torch.bfloat16)
    with _swap(swapped, "adamw", swap_dir=tmp_path / "run", **settings) as swap:
        for x in xs[:2]:
            reference.step(x)
            _swap_step(swapped, swap, x)
        swap.snapshot(tmp_path / "snap")
    resumed = copy.deepcopy(swapped)
    with _swap(
        resumed, "adamw", swap_dir=tmp_path / "run2", resume_from=tmp_path / "snap", **settings
    ) as swap:
        for x in xs[2:]:
            reference.step(x)
            _swap_step(resumed, swap, x)
        _assert_same(plain, resumed)
    with pytest.raises(ConfigError, match="state_precision"):
        _swap(resumed, "adamw", swap_dir=tmp_path / "run3", resume_from=tmp_path / "snap")


@pytest.mark.parametrize(
    ("setting", "value"), [("state_precision", "int4"), ("master", "fp16"), ("master", None)]
)
def test_unknown_formats_are_config_errors(setting: str, value: Any) -> None:
    _, model = _pair(torch.float32)
    with pytest.raises(ConfigError, match=setting):
        _swap(model, "adamw", **{setting: value})


def test_inspect_shows_the_formats(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from tierswap.cli import main

    _, model = _pair(torch.bfloat16)
    settings = {"state_precision": "8bit", "master": "remainder"}
    with _swap(model, "adamw", swap_dir=tmp_path / "s", **settings) as swap:
        _swap_step(model, swap, inputs(1, torch.bfloat16)[0])
    assert main(["inspect", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "formats     state_precision=8bit, master=remainder" in text
    assert "exp_avg.absmax exp_avg.codes" in text


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_resident_compact_slices_hold_no_work_buffers(precision: str, monkeypatch) -> None:
    """A slice resident between steps keeps its stored moments only: the fp32 decodings are
    one work buffer that every slice's step reuses (on the CPU), so the resident slices and
    that buffer (and the held 8-bit scales, which every slice views, resident or streamed)
    are all the host tier holds between steps, bitwise as the reference."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", 64 << 10)  # residency at a small budget
    plain, swapped = _pair(torch.float32, Wide)
    reference = Reference(plain, "adamw", precision)
    with _swap(copy.deepcopy(plain), "adamw", host_budget=None, state_precision=precision) as p:
        stored = sum(piece.held_bytes for piece in p.slices)
        scales = sum(slot.scales_bytes for slot in p._layout.slots)  # 8-bit: held when streaming
    budget = (64 << 10) + scales + stored // 2  # the streaming part, and room for half the state
    with _swap(swapped, "adamw", host_budget=budget, state_precision=precision) as swap:
        placed = [piece for piece in swap.slices if piece.index in swap.placement]
        assert 0 < len(placed) < len(swap.slices)
        work = max(piece.scratch_bytes for piece in swap.slices)
        scales = swap._layout.held_scales
        assert (scales > 0) == (precision == "8bit")
        own = [piece.held_bytes - (piece.scales_bytes if scales else 0) for piece in placed]
        resident = sum(own) + scales
        assert sum(own) < sum(piece.working_set for piece in placed)  # decodings left out
        pipeline = swap._backend.pipeline
        for step, x in enumerate(inputs(3, torch.float32)):
            reference.step(x)
            _swap_step(swapped, swap, x)
            swap.synchronize()
            if step > 0:  # the first step creates the state: nothing resident yet
                assert pipeline.held == resident + work <= budget
        _assert_same(plain, swapped)
