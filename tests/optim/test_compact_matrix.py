"""Compact state with every optimizer the library accepts (issue 17): each ``state_precision``
with each per-element optimizer, fp32 and bf16 parameters, bitwise against the reference loop
(:mod:`tests.optim.compact_reference`); Muon, stepped whole, stores its momentum compact too;
optimizers whose state is not all moments (ASGD, Rprop, Adafactor's factored statistics) keep
their state fp32 and exact; resume and snapshots carry each format over.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.optim.compact_reference import CompactReference, backward, inputs
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer
from tierswap.optim.formats import MIN_8BIT_NUMEL

#: Per-element optimizers whose per-element state is all moments: compact under every mode.
MOMENTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "rmsprop-centered": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
}
#: Per-element optimizers with state that is not a moment (a parameter average, a previous
#: gradient, step sizes): all of their state stays fp32.
NOT_MOMENTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "asgd": (torch.optim.ASGD, {"lr": 1e-2}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
}
#: Optimizers stepped whole (their math spans a matrix): Muon's momentum, a moment of the
#: parameter's size, is stored compact; Adafactor's factored statistics stay fp32.
WHOLE: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "muon": (torch.optim.Muon, {"lr": 1e-2}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}
WHOLE_BUDGET = "2MiB"  # a whole matrix per slice
BUDGETS = {torch.float32: "256KiB", torch.bfloat16: "320KiB"}  # everything streams


class Net(torch.nn.Module):
    """2-D weights only (Muon takes nothing else): one of 32768 elements that slices cut and
    8-bit compacts, one of 2048 (under ``MIN_8BIT_NUMEL``: fp32 under ``"8bit"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(128, 256, bias=False)
        self.head = torch.nn.Linear(256, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.big(x)))


def _models(dtype: torch.dtype) -> tuple[Net, Net]:
    torch.manual_seed(0)
    plain = Net().to(dtype)
    swapped = Net().to(dtype)
    swapped.load_state_dict(plain.state_dict())
    return plain, swapped


def _settings(dtype: torch.dtype, precision: str, **more: Any) -> dict[str, Any]:
    master = "remainder" if dtype == torch.bfloat16 else "fp32"
    settings = {"host_budget": BUDGETS[dtype], "state_precision": precision, "master": master}
    return {**settings, **more}


def _reference(
    model: Net, case: tuple[type[torch.optim.Optimizer], dict[str, Any]], precision: str
) -> CompactReference:
    """The loop the swapped run must equal: moments rounded where the optimizer compacts
    them (8-bit: tensors of ``MIN_8BIT_NUMEL`` elements or more)."""
    dtype = next(model.parameters()).dtype
    master = "remainder" if dtype == torch.bfloat16 else "fp32"

    def compact(name: str, numel: int) -> bool:
        return precision != "8bit" or numel >= MIN_8BIT_NUMEL

    optimizer_class, kwargs = case
    return CompactReference(
        model, optimizer_class, kwargs, precision, master=master, compact=compact
    )


def _run(
    plain: Net,
    swapped: Net,
    case: tuple[type[torch.optim.Optimizer], dict[str, Any]],
    *,
    precision: str,
    reference_precision: str,
    xs: list[torch.Tensor],
    **settings: Any,
) -> SwapOptimizer:
    """Step both in lock-step over ``xs``, checking the parameters after each step; the
    swapped optimizer is returned open."""
    dtype = next(plain.parameters()).dtype
    reference = _reference(plain, case, reference_precision)
    optimizer_class, kwargs = case
    swap = SwapOptimizer(
        swapped.parameters(), optimizer_class, **_settings(dtype, precision, **settings), **kwargs
    )
    for x in xs:
        reference.step(x)
        backward(swapped, x)
        swap.step()
        for (name, a), b in zip(plain.named_parameters(), swapped.parameters(), strict=True):
            assert torch.equal(a, b), f"{name} differs"
    swap.reference = reference  # type: ignore[attr-defined]
    return swap


def _assert_state_equal(reference: CompactReference, swap: SwapOptimizer) -> None:
    saved = swap.state_dict()["state"]
    for index, master in enumerate(reference.masters):
        for key, value in reference.opt.state[master].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved[index][key])), (
                index,
                key,
            )


def _stored_dtypes(swap: SwapOptimizer) -> dict[str, torch.dtype]:
    store = swap._backend.store
    return {key: store.info(key).dtype for key in store.keys()}  # noqa: SIM118 (a list)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("name", list(MOMENTS))
def test_every_per_element_optimizer_stores_its_moments_compact(
    name: str, precision: str, dtype: torch.dtype
) -> None:
    plain, swapped = _models(dtype)
    case = MOMENTS[name]
    with _run(
        plain,
        swapped,
        case,
        precision=precision,
        reference_precision=precision,
        xs=inputs(3, dtype),
    ) as swap:
        _assert_state_equal(swap.reference, swap)  # type: ignore[attr-defined]
        stored = _stored_dtypes(swap)
        big = [k for k in stored if k.startswith("p0/") and k not in ("p0/param", "p0/remainder")]
        assert big
        if precision == "fp32":
            assert all(stored[k] == torch.float32 for k in big), stored
        elif precision == "bf16":
            assert all(stored[k] == torch.bfloat16 for k in big), stored
        else:
            assert all(k.endswith((".codes", ".absmax")) for k in big), stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("name", [*NOT_MOMENTS, "adafactor"])
def test_state_that_is_not_moments_stays_fp32_and_exact(
    name: str, precision: str, dtype: torch.dtype
) -> None:
    """ASGD's parameter average, Rprop's step sizes and Adafactor's factored statistics are
    not moments: under any ``state_precision`` their state stays fp32, bitwise torch's (the
    bf16 parameters' masters still take ``master="remainder"``)."""
    plain, swapped = _models(dtype)
    case = {**NOT_MOMENTS, **WHOLE}[name]
    budget = {"host_budget": WHOLE_BUDGET} if name in WHOLE else {}
    with _run(
        plain, swapped, case, precision=precision, reference_precision="fp32",
        xs=inputs(3, dtype), **budget,
    ) as swap:  # fmt: skip
        _assert_state_equal(swap.reference, swap)  # type: ignore[attr-defined]
        stored = _stored_dtypes(swap)
        state = {k: v for k, v in stored.items() if k.split("/")[-1] not in ("param", "remainder")}
        state.pop("optim/small", None)
        assert state
        assert all(v == torch.float32 for v in state.values()), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_muon_stores_its_momentum_compact_stepped_whole(precision: str, dtype: torch.dtype) -> None:
    """Muon steps each matrix whole; its momentum is a moment of the matrix's size, stored in
    the format asked for (8-bit: the matrix of ``MIN_8BIT_NUMEL`` elements or more), bitwise
    the reference loop that rounds it after every step."""
    plain, swapped = _models(dtype)
    with _run(
        plain, swapped, WHOLE["muon"], precision=precision, reference_precision=precision,
        xs=inputs(3, dtype), host_budget=WHOLE_BUDGET,
    ) as swap:  # fmt: skip
        _assert_state_equal(swap.reference, swap)  # type: ignore[attr-defined]
        stored = _stored_dtypes(swap)
    if precision == "bf16":
        assert stored["p0/momentum_buffer"] == torch.bfloat16
        assert stored["p1/momentum_buffer"] == torch.bfloat16
    else:
        assert stored["p0/momentum_buffer.codes"] == torch.uint8
        assert stored["p1/momentum_buffer"] == torch.float32  # 2048 elements: under the floor


def test_a_muon_group_beside_adamw_compacts_both() -> None:
    torch.manual_seed(0)
    model = Net()
    groups = [
        {"params": [model.big.weight], "optimizer_class": torch.optim.Muon, "lr": 1e-2},
        {"params": [model.head.weight]},
    ]
    swap = SwapOptimizer(
        groups, torch.optim.AdamW, lr=1e-2, state_precision="bf16", host_budget=WHOLE_BUDGET
    )
    with swap:
        for x in inputs(2, torch.float32):
            backward(model, x)
            swap.step()
        stored = _stored_dtypes(swap)
    assert stored["p0/momentum_buffer"] == torch.bfloat16
    assert stored["p1/exp_avg"] == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("name", ["rmsprop-centered", "adagrad", "nadam", "muon"])
def test_resume_and_snapshot_carry_each_format_over(
    name: str, precision: str, tmp_path: Any
) -> None:
    """Two steps, close; resume for one step, snapshot; a run from the snapshot takes the
    last step: bitwise the four steps of the reference loop."""
    plain, swapped = _models(torch.bfloat16)
    case = {**MOMENTS, **WHOLE}[name]
    xs = inputs(4, torch.bfloat16)
    folder = {"swap_dir": tmp_path / "run"}
    budget = {"host_budget": WHOLE_BUDGET} if name in WHOLE else {}
    with _run(
        plain, swapped, case, precision=precision, reference_precision=precision, xs=xs[:2],
        **folder, **budget,
    ) as swap:  # fmt: skip
        reference = swap.reference  # type: ignore[attr-defined]
    optimizer_class, kwargs = case
    settings = _settings(torch.bfloat16, precision, **budget)
    with SwapOptimizer(
        swapped.parameters(), optimizer_class, resume=True, **folder, **settings, **kwargs
    ) as swap:
        assert swap.steps == 2
        reference.step(xs[2])
        backward(swapped, xs[2])
        swap.step()
        swap.snapshot(tmp_path / "snap")
    with SwapOptimizer(
        swapped.parameters(), optimizer_class, swap_dir=tmp_path / "run2",
        resume_from=tmp_path / "snap", **settings, **kwargs,
    ) as swap:  # fmt: skip
        assert swap.steps == 3
        reference.step(xs[3])
        backward(swapped, xs[3])
        swap.step()
        for (label, a), b in zip(plain.named_parameters(), swapped.parameters(), strict=True):
            assert torch.equal(a, b), f"{label} differs"
        _assert_state_equal(reference, swap)


@pytest.mark.parametrize(("first", "then"), [("bf16", "fp32"), ("fp32", "8bit"), ("8bit", "bf16")])
def test_resuming_a_snapshot_with_another_precision_names_both(
    first: str, then: str, tmp_path: Any
) -> None:
    plain, swapped = _models(torch.float32)
    case = MOMENTS["sgd-momentum"]
    with _run(
        plain, swapped, case, precision=first, reference_precision=first,
        xs=inputs(1, torch.float32),
    ) as swap:  # fmt: skip
        swap.snapshot(tmp_path / "snap")
    optimizer_class, kwargs = case
    with pytest.raises(ConfigError, match="state_precision") as caught:
        SwapOptimizer(
            swapped.parameters(), optimizer_class, swap_dir=tmp_path / "run",
            resume_from=tmp_path / "snap", **_settings(torch.float32, then), **kwargs,
        )  # fmt: skip
    assert repr(first) in str(caught.value)
    assert repr(then) in str(caught.value)
