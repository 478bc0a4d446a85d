"""Streamed parameters used where no hook of their own module runs (the StreamedParameter
guard): a parent's forward, ``nn.MultiheadAttention``'s functional form, the training loop."""

from __future__ import annotations

import copy
import gc
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.optim.models import batch_for_step
from tierswap.errors import ConfigError, StoreClosedError
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import _memory
from tierswap.optim.stream._guard import StreamedParameter

KWARGS = {"lr": 1e-2, "weight_decay": 0.05}


class Borrowing(torch.nn.Module):
    """The root's forward reads its children's parameters itself: a head tied to the first
    layer's weight (through a view) and an elementwise use of a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.inp(x)))
        return torch.nn.functional.linear(h, self.inp.weight.t()) * (1 + self.mid.bias.mean())


class Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` hands ``out_proj``'s parameters to its functional form: the
    ``out_proj`` module never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x.view(2, 3, 8)))


def _held(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _penalty(model: torch.nn.Module) -> torch.Tensor:
    return 1e-3 * sum(p.square().sum() for p in model.parameters())  # type: ignore[return-value]


Between = Callable[[torch.nn.Module, torch.nn.Module, SwapOptimizer], None]


def _train_pair(
    tmp_path: Path,
    make: type[torch.nn.Module],
    steps: int,
    penalty: str | None = None,
    between: Between | None = None,
    **options: Any,
) -> tuple[torch.nn.Module, SwapOptimizer]:
    """Train ``make()`` with torch's AdamW and a copy with streamed parameters, in lock-step
    (``penalty``: a weight penalty on every parameter, computed "before" or "after" the
    forward, in the training loop; ``between(in_memory, streamed, optimizer)`` after each
    step); check them bitwise at each step and return the streamed one and its optimizer
    (still open)."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, offload_parameters=True,
        **KWARGS, **{"host_budget": 20480, **options},
    )  # fmt: skip
    for step in range(steps):
        for m, o in ((ref, plain), (model, opt)):
            before = _penalty(m) if penalty == "before" else 0.0
            loss = m(batch_for_step(step)).square().mean() + before
            if penalty == "after":
                loss = loss + _penalty(m)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
        if not options.get("device_budget"):
            assert _held(model) == 0  # every parameter is back in the swap space
        expected = ref.state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), (step, key)
        if between is not None:
            between(ref, model, opt)
    return model, opt


@pytest.mark.parametrize("make", [Borrowing, Attention])
def test_parameters_used_outside_their_modules_forward_train_bitwise(
    tmp_path: Path, make: type[torch.nn.Module]
) -> None:
    model, opt = _train_pair(tmp_path, make, 4)
    fetched = opt.tier_stats()["parameters"]["fetched_bytes"]
    model(batch_for_step(9)).sum().backward()  # an iteration reads each use's values once
    per_iteration = opt.tier_stats()["parameters"]["fetched_bytes"] - fetched
    assert per_iteration <= 2 * _values(model)  # forward and backward
    opt.zero_grad()
    opt.close()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert _held(model) == _values(model)


def _values(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("penalty", ["before", "after"])
def test_a_weight_penalty_in_the_training_loop_trains_bitwise(tmp_path: Path, penalty: str) -> None:
    _, opt = _train_pair(tmp_path, Borrowing, 3, penalty)
    opt.close()


def test_a_freed_parameter_is_read_for_a_use_between_steps(tmp_path: Path) -> None:
    model, opt = _train_pair(tmp_path, Borrowing, 2)
    weight = model.mid.weight
    assert isinstance(weight, StreamedParameter)
    assert "swap space" in repr(weight)  # repr reads no values while it holds none
    expected = model.state_dict()["mid.weight"]
    with torch.no_grad():
        assert torch.equal(weight + 1, expected + 1)  # an elementwise kernel: it reads them
        assert torch.equal(weight.view(-1)[:5], expected.view(-1)[:5])
    assert "Parameter containing" in repr(weight)  # it holds its values now
    model(batch_for_step(5)).sum().backward()  # then trains on
    opt.step()
    assert _held(model) == 0
    stored = model.state_dict()
    opt.close()  # gives every parameter its values back: the stored ones
    for name, param in model.named_parameters():
        assert type(param) is torch.nn.Parameter
        assert torch.equal(param, stored[name]), name


def _saved_and_loaded(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


COPIERS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "torch.save": _saved_and_loaded,
}


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copy_of_a_streamed_model_is_plain_and_leaves_the_stream_alone(
    tmp_path: Path, copier: str
) -> None:
    """torch's own copy of a parameter reads its storage: a freed one crashed the process."""

    def check(_: torch.nn.Module, model: torch.nn.Module, opt: SwapOptimizer) -> None:
        values = model.state_dict()
        twin = COPIERS[copier](model)
        for name, param in twin.named_parameters():
            assert type(param) is torch.nn.Parameter, name
            assert torch.equal(param, values[name]), name
        assert _held(model) == 0  # reading the values gave the streamed ones no memory
        fetched = opt.tier_stats()["parameters"]["fetched_bytes"]
        twin(batch_for_step(7)).sum().backward()  # the copy's hooks do nothing
        assert opt.tier_stats()["parameters"]["fetched_bytes"] == fetched
        assert all(type(p.grad) is torch.Tensor for p in twin.parameters())
        assert all(isinstance(p, StreamedParameter) for p in model.parameters())

    _, opt = _train_pair(tmp_path, Borrowing, 3, between=check)  # and trains on, bitwise
    opt.close()


@pytest.mark.parametrize("ema", [False, True])
def test_an_averaged_model_of_streamed_parameters_averages_their_values(
    tmp_path: Path, ema: bool
) -> None:
    """``AveragedModel`` copies the model and reads ``p.detach()`` of each parameter (one at a
    time, or all in one foreach op for an EMA)."""
    kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(0.9)} if ema else {}
    averaged: dict[int, AveragedModel] = {}

    def update(ref: torch.nn.Module, model: torch.nn.Module, _: SwapOptimizer) -> None:
        for m in (ref, model):
            averaged.setdefault(id(m), AveragedModel(m, **kwargs)).update_parameters(m)
        assert _held(model) == 0
        expected = averaged[id(ref)].state_dict()
        for key, value in averaged[id(model)].state_dict().items():
            assert torch.equal(value, expected[key]), key

    _, opt = _train_pair(tmp_path, Borrowing, 3, between=update)
    opt.close()


def test_a_parameter_whose_optimizer_was_dropped_unclosed_says_where_its_values_are(
    tmp_path: Path,
) -> None:
    model, opt = _train_pair(tmp_path, Borrowing, 1)
    del opt
    gc.collect()
    assert _memory._idle_threshold() == _memory.IDLE_MMAP_THRESHOLD  # its hold went with it
    with pytest.raises(StoreClosedError, match="without close"):
        model.mid.weight + 1
    with pytest.raises(StoreClosedError):
        copy.deepcopy(model)


EDITS: dict[str, Callable[[torch.nn.Module], object]] = {
    "init": lambda m: torch.nn.init.normal_(
        m.mid.weight, std=0.1, generator=torch.Generator().manual_seed(3)
    ),
    "no_grad": lambda m: m.inp.weight.mul_(0.5),
    "data": lambda m: m.mid.weight.data.clamp_(-0.05, 0.05),  # WGAN's clipping
    "detach": lambda m: m.inp.bias.detach().add_(1.0),
    "copy": lambda m: m.mid.bias.copy_(torch.linspace(-1, 1, 16)),
    "set_data": lambda m: setattr(m.inp.bias, "data", torch.linspace(0, 1, 16)),
    "vector": lambda m: torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(m.parameters()).mul(0.9), m.parameters()
    ),
}


@pytest.mark.parametrize("where", ["streamed", "kept", "resident"])
@pytest.mark.parametrize("edit", EDITS)
def test_values_written_outside_the_optimizer_become_the_masters(
    tmp_path: Path, edit: str, where: str
) -> None:
    """An in-place write into a streamed parameter between steps (lent its values for the
    operation, or keeping them in ``device_budget``) is what the next step starts from, as
    in memory; it used to be freed with the values, silently."""

    def write(ref: torch.nn.Module, model: torch.nn.Module, _: SwapOptimizer) -> None:
        held.append(_held(model))
        with torch.no_grad():
            for m in (ref, model):
                EDITS[edit](m)
        expected = ref.state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), key

    held: list[int] = []
    with torch.device("meta"):  # a device budget that keeps the parameters alone
        kept = sum(p.numel() * p.element_size() for p in Borrowing().parameters())
    budget = {"kept": {"device_budget": kept}, "resident": {"host_budget": None}}
    _, opt = _train_pair(tmp_path, Borrowing, 3, between=write, **budget.get(where, {}))
    resident = bool(opt.placement)
    opt.close()
    assert (max(held) > 0) == (where == "kept")  # they held their values between steps
    assert resident == (where == "resident")  # the slices stay in memory: the edit goes there


def test_an_edit_of_bf16_values_keeps_the_remainder_as_in_memory(tmp_path: Path) -> None:
    """With ``master="remainder"`` an edit of a streamed bf16 parameter changes its stored
    values and keeps its remainder, as the same optimizer does with the parameters in memory."""
    torch.manual_seed(0)
    base = Borrowing().to(torch.bfloat16)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [
        SwapOptimizer(
            model,
            torch.optim.AdamW,
            swap_dir=tmp_path / str(streamed),
            master="remainder",
            offload_parameters=streamed,
            **KWARGS,
        )
        for model, streamed in zip(models, (False, True), strict=True)
    ]
    for step in range(4):
        for model, opt in zip(models, opts, strict=True):
            model(batch_for_step(step).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                with torch.no_grad():
                    model.inp.weight.mul_(0.5)
                    model.mid.bias.data.clamp_(-0.01, 0.01)
        expected = models[0].state_dict()
        for key, value in models[1].state_dict().items():
            assert torch.equal(value, expected[key]), (step, key)
    for opt in opts:
        opt.close()


def test_the_data_of_another_dtype_is_refused_and_the_values_stay(tmp_path: Path) -> None:
    """``model.half()`` sets each parameter's ``.data`` to a cast copy: a streamed parameter
    keeps its own memory and dtype, so it refuses, and training goes on from the stored
    values."""
    vector = torch.zeros(16)

    def cast(ref: torch.nn.Module, model: torch.nn.Module, _: SwapOptimizer) -> None:
        with pytest.raises(ConfigError, match="another shape, dtype or device"):
            model.half()
        with pytest.raises(ConfigError):
            model.mid.bias.data = torch.zeros(4)
        with torch.no_grad():
            ref.inp.bias.data = vector.clone()  # torch's parameter takes the memory given
            model.inp.bias.data = vector  # copied in: the stream never frees the caller's

    _, opt = _train_pair(tmp_path, Borrowing, 3, between=cast)
    assert torch.equal(vector, torch.zeros(16))
    opt.close()


class Tagged(torch.nn.Parameter):
    """A subclass of ``Parameter`` that leaves ``__torch_function__`` to torch (as libraries
    tag parameters)."""


class TaggedBorrowing(Borrowing):
    def __init__(self) -> None:
        super().__init__()
        self.inp.weight = Tagged(self.inp.weight.detach())


def test_a_parameter_of_a_subclass_is_guarded_and_gets_its_class_back(tmp_path: Path) -> None:
    model, opt = _train_pair(tmp_path, TaggedBorrowing, 3)  # the root's forward uses inp.weight
    weight = model.inp.weight
    assert isinstance(weight, StreamedParameter)
    assert isinstance(weight, Tagged)
    assert type(copy.deepcopy(model).inp.weight) is Tagged
    opt.close()
    assert type(weight) is Tagged
    assert all(
        type(p) is torch.nn.Parameter for n, p in model.named_parameters() if n != "inp.weight"
    )


class OwnHandler(torch.nn.Parameter):
    """A subclass of ``Parameter`` with a ``__torch_function__`` of its own (which the guard
    cannot sit beside)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


class OwnHandled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.mid.weight = OwnHandler(self.mid.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(torch.tanh(self.inp(x))))


def test_a_parameter_the_guard_cannot_take_is_named_in_a_warning(tmp_path: Path) -> None:
    """Unguarded, a use of it outside its module would read freed memory: the user is told
    which; inside its module it streams as the others do (bitwise, checked each step)."""
    with pytest.warns(UserWarning, match=r"'mid\.weight' .*own __torch_function__") as caught:
        model, opt = _train_pair(tmp_path, OwnHandled, 2)
    assert caught[0].filename == __file__  # it points at the optimizer's construction
    assert type(model.mid.weight) is OwnHandler
    assert isinstance(model.inp.weight, StreamedParameter)
    opt.close()


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's own, on what it does not trace
def test_a_compiled_model_streams_bitwise(tmp_path: Path) -> None:
    """Dynamo traces neither the guard (it recursed until the stack ran out) nor the stream's
    hooks: each operation on a streamed parameter and each hook is a graph break, and
    training is torch's."""
    torch.manual_seed(0)
    ref = Borrowing()
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, offload_parameters=True, **KWARGS
    )
    compiled = torch.compile(model, backend="aot_eager")  # its autograd traced, no C++ build
    for step in range(3):
        for m, o in ((ref, plain), (compiled, opt)):
            m(batch_for_step(step)).square().mean().backward()
            o.step()
            o.zero_grad()
        expected = ref.state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), (step, key)
    opt.close()
