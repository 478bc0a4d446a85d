"""Parameter streaming (``offload_parameters=True``): the parameters hold no memory between
uses, each module's come back for its forward and its backward, and training is bitwise the
training of the plain optimizer (torch's AdamW in memory, or a SwapOptimizer that does not
stream), with clipping, a GradScaler, tied weights, activation checkpointing, accumulation,
param groups and resumes."""

from __future__ import annotations

import copy
import itertools
import os
import random
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.optim.models import (
    TinyNet,
    assert_same_params,
    assert_same_state,
    batch_for_step,
    make_models,
)
from tests.optim.stream.lockstep import train_gpt2_lockstep
from tests.optim.train_child import muon_groups
from tests.store.faults import inject, remove
from tierswap import offload
from tierswap.errors import ConfigError, GradientOffloadedError
from tierswap.optim import SwapOptimizer, _assembly
from tierswap.optim.step import _runner, _speculation
from tierswap.optim.step._runner import SliceRunner
from tierswap.optim.stream import OffloadedGradient
from tierswap.optim.stream._ahead import ReadsAhead
from tierswap.pipeline import Job, Pipeline, Region
from tierswap.tiers import DEVICE

KWARGS = {"lr": 1e-2, "weight_decay": 0.05}
#: Random schedules the lock-step test runs (two unless slow tests run; more for a soak:
#: TIERSWAP_STREAM_SEEDS=40 pytest -m slow -k random).
SEEDS = int(os.environ.get("TIERSWAP_STREAM_SEEDS", "6"))


class Net(torch.nn.Module):
    """Linear layers with a LayerNorm between them, and a parameter of the root module."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.mid = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.mid(h))) * self.scale


def _values_bytes(make: Callable[[], torch.nn.Module]) -> int:
    """The bytes of the parameters of ``make()``: a ``device_budget`` that keeps every one
    between uses and leaves nothing to optimizer state (what they leave of a larger budget
    holds state, on a machine without a GPU)."""
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in make().parameters())


#: A device budget that keeps all of Net's parameters and holds no optimizer state.
ALL_KEPT = _values_bytes(Net)
#: Budgets that keep every parameter between uses and every slice resident in a tier: host
#: memory, or what the parameters leave of ``device_budget`` (no GPU: RAM as well).
RESIDENT_IN: dict[str, dict[str, object]] = {
    "host": {"host_budget": None, "device_budget": ALL_KEPT},
    "device": {"host_budget": 20480, "device_budget": ALL_KEPT + (1 << 20)},
}


def _pair(seed: int = 0) -> tuple[Net, Net]:
    torch.manual_seed(seed)
    model = Net()
    return model, copy.deepcopy(model)


def _streaming(
    tmp_path: Path, **settings: object
) -> tuple[Net, Net, torch.optim.Optimizer, SwapOptimizer]:
    """A Net and its copy, torch's AdamW on the first and a streaming SwapOptimizer (host
    budget 20 KiB unless ``settings`` say otherwise) on the second."""
    ref, model = _pair()
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    settings = {"swap_dir": tmp_path, "host_budget": 20480, **settings}
    opt = SwapOptimizer(model, torch.optim.AdamW, offload_parameters=True, **settings, **KWARGS)
    return ref, model, plain, opt


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, clip: float | None = None
) -> torch.Tensor | None:
    """One step, with clipping unless ``clip`` is ``None``; the total norm of the gradients
    (``None`` without clipping)."""
    model(batch_for_step(step)).square().mean().backward()
    norm = None if clip is None else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return norm


def _read(opt: SwapOptimizer) -> int:
    """Bytes the swap tier has delivered: read from the drive, or copied from a write still
    in flight (which of the two depends on the threads' timing)."""
    nvme = opt.tier_stats()["nvme"]
    return nvme["bytes_read"] + nvme["bytes_forwarded"]


def _held(model: torch.nn.Module) -> int:
    """Bytes the model's parameters hold now."""
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _same_state_dicts(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert torch.equal(value, sb[key]), key


@pytest.mark.parametrize("overlap", ["auto", None, "forward"])
@pytest.mark.parametrize("host_budget", [20480, None], ids=["streamed", "resident"])
@pytest.mark.parametrize("clip", [0.05, 1000.0], ids=["clip-always", "clip-never"])
def test_training_is_bitwise_torch_adamw(
    tmp_path: Path, overlap: str | None, host_budget: int | None, clip: float
) -> None:
    ref, model = _pair()
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=host_budget, overlap=overlap,
        offload_parameters=True, commit_every=2, **KWARGS,
    )  # fmt: skip
    assert _held(model) == 0  # the store holds the values
    fetched = []
    for step in range(5):
        norm = _train(ref, plain, step, clip)
        assert torch.equal(_train(model, opt, step, clip), norm)
        assert _held(model) == 0
        _same_state_dicts(ref, model)  # model.state_dict() reads the streamed values
        fetched.append(opt.tier_stats()["parameters"]["fetched_bytes"])
    stats = opt.tier_stats()["parameters"]
    assert stats["streamed"] == len(list(model.parameters()))
    assert stats["live_bytes"] == 0
    schedule = opt.tier_stats()["schedule"]
    if overlap is not None:  # slices step in backward from step 2 (resident ones: where the
        assert schedule["speculated"] > 0  # step before committed, or they were not yet)
        assert (schedule["redone"] > 0) == (clip < 1.0)  # clipping changed their gradients
    else:  # no speculation to report
        assert schedule == {"overlap": overlap}
    if host_budget is None:  # slices stay resident from their second step: copied from there
        assert fetched[0] > 0
        assert fetched[-1] == fetched[1]
        assert stats["copied_bytes"] > 0
    else:
        assert opt.placement == {}
        assert stats["copied_bytes"] == 0
        assert fetched[-1] > fetched[0] > 0
    opt.close()
    assert_same_params(ref, model)  # close() gives the model its values back
    assert _held(model) == sum(p.numel() * 4 for p in model.parameters())


def test_only_the_running_module_holds_its_parameters(tmp_path: Path) -> None:
    _, model = _pair()
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=20480,
        offload_parameters=True, **KWARGS,
    )  # fmt: skip
    seen: list[tuple[str, int, int]] = []  # module, bytes it owns, bytes all params hold

    def record(module: torch.nn.Module, *_: object) -> None:
        owned = sum(p.untyped_storage().nbytes() for p in module.parameters(recurse=False))
        seen.append((type(module).__name__, owned, _held(model)))

    for child in (model.inp, model.norm, model.mid, model.out):
        child.register_forward_pre_hook(record)  # after the stream's own
    for step in range(3):
        seen.clear()
        _train(model, opt, step, 1.0)
        for name, owned, held in seen:
            # the module's own parameters, and the root's scale (its forward runs around them)
            assert owned > 0, name
            assert held == owned + 16, (name, owned, held)
    largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    assert opt.tier_stats()["parameters"]["peak_bytes"] == largest + 16
    opt.close()


transformers = pytest.importorskip("transformers")


def _gpt2(checkpointing: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing != "none":
        reentrant = {"use_reentrant": checkpointing == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # newer transformers
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
    return model.train()


@pytest.mark.parametrize("checkpointing", ["none", "non-reentrant", "reentrant"])
def test_gpt2_with_tied_weights_matches_the_optimizer_that_does_not_stream(
    tmp_path: Path, checkpointing: str
) -> None:
    ref, model = _gpt2(checkpointing), _gpt2(checkpointing)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: first and last module
    plain = SwapOptimizer(ref, torch.optim.AdamW, swap_dir=tmp_path / "a", host_budget=20480)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path / "b", host_budget=20480,
        offload_parameters=True,
    )  # fmt: skip

    def nothing_held() -> None:
        assert _held(model) == 0

    train_gpt2_lockstep([(ref, plain), (model, opt)], 4, after_step=nothing_held)
    _same_state_dicts(ref, model)
    plain.close()
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("overlap", ["auto", "forward"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-with-fp32-masters"]
)
def test_gpt2_with_streamed_parameters_ends_equal_to_the_training_in_memory(
    tmp_path: Path, dtype: torch.dtype, overlap: str
) -> None:
    """GPT-2 (tied weights), clipping every step, 5 steps: fp32 against torch's AdamW in
    memory; bf16 parameters with fp32 masters against a SwapOptimizer holding everything in
    memory (torch's AdamW keeps no masters). Every parameter and state tensor bitwise."""
    ref, model = _gpt2("none").to(dtype), _gpt2("none").to(dtype)
    assert model.lm_head.weight is model.transformer.wte.weight
    if dtype == torch.float32:
        plain: torch.optim.Optimizer = torch.optim.AdamW(ref.named_parameters())
    else:
        plain = SwapOptimizer(ref, torch.optim.AdamW, swap_dir=tmp_path / "a", host_budget=None)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path / "b", host_budget=40960,
        offload_parameters=True, overlap=overlap,
    )  # fmt: skip
    train_gpt2_lockstep([(ref, plain), (model, opt)], 5)
    _same_state_dicts(ref, model)
    assert_same_state(plain.state_dict(), opt.state_dict())
    if isinstance(plain, SwapOptimizer):
        plain.close()
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize(
    ("master", "host_budget", "device_budget"),
    [
        ("fp32", 20480, 0),
        ("remainder", 32768, 0),
        ("remainder", None, 0),
        ("remainder", 32768, 1 << 20),
    ],
    ids=["fp32-master", "remainder", "remainder-resident", "remainder-kept"],
)
def test_bf16_parameters_match_the_optimizer_that_does_not_stream(
    tmp_path: Path, master: str, host_budget: int | None, device_budget: int
) -> None:
    """bf16 parameters with fp32 masters, or with ``master="remainder"``: then the stored
    bf16 parameter is what each use reads (2 bytes an element, not the 4 of a master), and
    the step reads it with the remainder, rebuilds the fp32 master exactly and writes both;
    with slices resident, and with parameters kept between uses (``device_budget``)."""
    ref, model = make_models(dtype=torch.bfloat16)
    plain = SwapOptimizer(ref, torch.optim.AdamW, swap_dir=tmp_path / "a", master=master, **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path / "b", host_budget=host_budget,
        device_budget=device_budget, offload_parameters=True, master=master, commit_every=2,
        **KWARGS,
    )  # fmt: skip
    fetched = []
    for step in range(5):
        for m, o in ((ref, plain), (model, opt)):
            m(batch_for_step(step, torch.bfloat16)).float().square().mean().backward()
            o.step()
            o.zero_grad()
        _same_state_dicts(ref, model)
        fetched.append(opt.tier_stats()["parameters"]["fetched_bytes"])
    if master == "remainder" and host_budget is not None and not device_budget:
        numel = sum(p.numel() for p in model.parameters())
        # forward, backward and the state dict's read: 2 bytes an element each
        assert fetched[1] - fetched[0] == 3 * 2 * numel
    plain.close()
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("host_budget", [20480, 65536], ids=["tight", "reads-ahead"])
def test_accumulation_and_evaluation_between_steps(tmp_path: Path, host_budget: int) -> None:
    """Two backward passes per step; with room to read ahead, the first pass starts reading
    slices whose kept gradients the second one replaces."""
    ref, model, plain, opt = _streaming(tmp_path, host_budget=host_budget, policy="lru")
    assert opt.placement == {}
    evaluated: dict[bool, torch.Tensor] = {}
    for step in range(3):
        for m, o in ((ref, plain), (model, opt)):
            for half in range(2):  # two backward passes per step
                m(batch_for_step(10 * step + half)).square().mean().backward()
            o.step()
            o.zero_grad()
            with torch.no_grad():
                evaluated[m is model] = m(batch_for_step(99))
        assert _held(model) == 0
        assert torch.equal(evaluated[True], evaluated[False])
    opt.close()
    assert_same_params(ref, model)


def test_a_resumed_run_continues_bitwise(tmp_path: Path) -> None:
    ref, model = _pair()
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    settings = {"swap_dir": tmp_path, "host_budget": 20480, "offload_parameters": True}
    opt = SwapOptimizer(model, torch.optim.AdamW, **settings, **KWARGS)
    for step in range(3):
        _train(ref, plain, step, 0.5)
        _train(model, opt, step, 0.5)
    opt.close()
    _, fresh = _pair(seed=7)  # other initial values: the resume replaces them
    opt = SwapOptimizer(fresh, torch.optim.AdamW, resume=True, **settings, **KWARGS)
    assert _held(fresh) == 0
    _same_state_dicts(ref, fresh)
    for step in range(3, 5):
        _train(ref, plain, step, 0.5)
        _train(fresh, opt, step, 0.5)
    opt.close()
    assert_same_params(ref, fresh)


def test_a_resumed_remainder_run_and_a_loaded_model_continue_bitwise(tmp_path: Path) -> None:
    """bf16 parameters under ``master="remainder"``: the stored parameter and remainder are
    committed and resumed, and ``model.load_state_dict()`` writes both."""
    ref, model = make_models(dtype=torch.bfloat16)
    settings = {"master": "remainder", **KWARGS}
    plain = SwapOptimizer(ref, torch.optim.AdamW, swap_dir=tmp_path / "a", **settings)
    streaming = {"swap_dir": tmp_path / "b", "host_budget": 32768, "offload_parameters": True}
    opt = SwapOptimizer(model, torch.optim.AdamW, **streaming, **settings)

    def train(m: torch.nn.Module, o: torch.optim.Optimizer, step: int) -> None:
        m(batch_for_step(step, torch.bfloat16)).float().square().mean().backward()
        o.step()
        o.zero_grad()

    for step in range(3):
        train(ref, plain, step)
        train(model, opt, step)
    opt.close()
    _, fresh = make_models(dtype=torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in fresh.parameters():  # other values: the resume replaces them
            p.add_(1.0)
    opt = SwapOptimizer(fresh, torch.optim.AdamW, resume=True, **streaming, **settings)
    _same_state_dicts(ref, fresh)
    train(ref, plain, 3)
    train(fresh, opt, 3)
    loaded = {k: v + 0.5 for k, v in ref.state_dict().items()}  # bf16 values, new masters
    ref.load_state_dict(loaded)
    fresh.load_state_dict(loaded)
    plain.load_state_dict(plain.state_dict())  # the plain optimizer refreshes its masters
    train(ref, plain, 4)
    train(fresh, opt, 4)
    _same_state_dicts(ref, fresh)
    plain.close()
    opt.close()


def test_a_failed_read_raises_and_leaves_the_parameters_free(tmp_path: Path) -> None:
    ref, model, plain, opt = _streaming(tmp_path)
    _train(ref, plain, 0, 1.0)
    _train(model, opt, 0, 1.0)
    store = opt._backend.store
    inject(store, fail={"read_file": {1}})
    with pytest.raises(OSError, match="Input/output error"):
        model(batch_for_step(1))
    remove(store)
    assert _held(model) == 0
    opt.zero_grad()
    for step in range(1, 3):  # the same model trains on, exactly
        _train(ref, plain, step, 1.0)
        _train(model, opt, step, 1.0)
    opt.close()
    assert_same_params(ref, model)


def test_clipping_by_value_is_recorded_and_applied_as_torch_applies_it(tmp_path: Path) -> None:
    """``clip_grad_value_`` (Lightning's ``gradient_clip_algorithm="value"``) clamps each kept
    gradient, the foreach clamps do the same, and a norm taken after them is the clamped
    gradient's; training stays bitwise."""
    ref, model, plain, opt = _streaming(tmp_path)
    for step in range(3):
        for m in (ref, model):
            m(batch_for_step(step)).square().mean().backward()
            torch.nn.utils.clip_grad_value_(m.parameters(), 0.004)
        grads = [[p.grad for p in m.parameters()] for m in (ref, model)]
        for g in grads:
            torch._foreach_clamp_min_(g, -0.003)
            torch._foreach_clamp_max_(g, 0.002)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        assert torch.equal(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01), want)
        for o in (plain, opt):
            o.step()
            o.zero_grad()
        assert_same_params(ref, model)
    model(batch_for_step(0)).sum().backward()
    grad = next(model.parameters()).grad
    assert grad is not None
    with pytest.raises(GradientOffloadedError):  # a bound that is a whole tensor
        grad.clamp_(min=torch.zeros(3))
    opt.close()


def test_several_ranks_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DistributedDataParallel(model)`` read the freed parameters (a segfault with two gloo
    ranks): under a process group of several ranks streaming is refused, the model kept."""
    _, model = _pair()
    monkeypatch.setattr(_assembly, "world", lambda: (0, 2))
    with pytest.raises(ConfigError, match="process group of 2 ranks"):
        SwapOptimizer(model, torch.optim.AdamW, swap_dir=tmp_path, offload_parameters=True)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_what_it_does_not_support_is_refused_clearly(tmp_path: Path) -> None:
    _, model = _pair()
    with pytest.raises(ConfigError, match="needs the model"):
        SwapOptimizer(model.parameters(), torch.optim.AdamW, offload_parameters=True)
    with pytest.raises(ConfigError, match="needs the model"):
        offload(torch.optim.AdamW(model.parameters()), offload_parameters=True)
    with pytest.raises(ConfigError, match="must be a bool"):
        SwapOptimizer(model, torch.optim.AdamW, offload_parameters="yes")  # type: ignore[arg-type]
    flat = torch.nn.Parameter(torch.zeros(10))
    viewed = TinyNet()
    viewed.unused = torch.nn.Parameter(flat.data[:5])  # a view into a larger buffer
    with pytest.raises(ConfigError, match="view into a larger buffer"):
        SwapOptimizer(viewed, torch.optim.AdamW, offload_parameters=True)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # untouched
    opt = SwapOptimizer(model, torch.optim.AdamW, swap_dir=tmp_path, offload_parameters=True)
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="not parameters of the model"):
        opt.add_param_group({"params": [("stray", stray)]})
    assert len(opt.param_groups) == 1  # the refused group left nothing behind
    assert stray.untyped_storage().nbytes() == 12
    opt.close()


@pytest.mark.parametrize(
    ("host_budget", "device_budget"),
    [(24576, 0), (None, 0), (24576, 1 << 20)],
    ids=["streamed", "resident", "kept"],
)
def test_a_param_group_added_later_streams_and_trains_bitwise(
    tmp_path: Path, host_budget: int | None, device_budget: int
) -> None:
    """A model's head joins the optimizer after two steps (as when layers are unfrozen): its
    parameters stream from then on, hold no memory between uses (beyond ``device_budget``),
    and the run stays bitwise torch's AdamW with the same groups."""
    ref, model = _pair()
    body = ["inp", "norm", "mid"]
    groups = lambda net: [p for n, p in net.named_parameters() if n.split(".")[0] in body]  # noqa: E731
    heads = lambda net: [p for n, p in net.named_parameters() if n.split(".")[0] not in body]  # noqa: E731
    plain = torch.optim.AdamW(groups(ref), **KWARGS)
    opt = SwapOptimizer(
        groups(model), torch.optim.AdamW, model=model, offload_parameters=True,
        swap_dir=tmp_path, host_budget=host_budget, device_budget=device_budget, **KWARGS,
    )  # fmt: skip
    for step in range(2):
        _train(ref, plain, step, 1.0)
        _train(model, opt, step, 1.0)
    assert all(p.untyped_storage().nbytes() > 0 for p in heads(model))  # not streamed yet
    plain.add_param_group({"params": heads(ref), "lr": 1e-3})
    opt.add_param_group({"params": heads(model), "lr": 1e-3})
    assert _held(model) == 0  # the added parameters left memory too (and the kept ones)
    for step in range(2, 5):
        _train(ref, plain, step, 1.0)
        _train(model, opt, step, 1.0)
        assert _held(model) <= device_budget
    assert opt.tier_stats()["parameters"]["streamed"] == len(list(model.parameters()))
    opt.close()
    assert_same_params(ref, model)


def test_an_added_group_whose_first_step_does_not_fit_is_refused_whole(tmp_path: Path) -> None:
    """At 20 KiB a 1024-element slice's first step (20 KiB) cannot run beside the 4 KiB work
    buffer the stepped slices share: add_param_group refuses it and changes nothing."""
    ref, model = _pair()
    heads = [p for n, p in model.named_parameters() if n.split(".")[0] in ("out", "scale")]
    body = [p for p in model.parameters() if all(p is not h for h in heads)]
    plain = torch.optim.AdamW(
        [p for n, p in ref.named_parameters() if not n.startswith(("out", "scale"))], **KWARGS
    )
    opt = SwapOptimizer(
        body, torch.optim.AdamW, model=model, offload_parameters=True, swap_dir=tmp_path,
        host_budget=20480, **KWARGS,
    )  # fmt: skip
    for step in range(3):
        if step == 2:
            with pytest.raises(ConfigError, match="added group"):
                opt.add_param_group({"params": heads, "lr": 1e-3})
            assert len(opt.param_groups) == 1
            assert all(p.untyped_storage().nbytes() > 0 for p in heads)  # still the model's
        _train(ref, plain, step, 1.0)
        _train(model, opt, step, 1.0)
    opt.close()
    assert_same_params(ref, model)


def test_gradients_live_in_the_swap_space_and_clipping_reads_them_there(tmp_path: Path) -> None:
    """No gradient memory after backward; torch's clipping (its per-tensor and foreach paths,
    any norm, twice) and the optimizer's give the total norms and factors torch gives in
    memory; other uses of a kept gradient raise."""
    ref, model, plain, opt = _streaming(tmp_path)
    for step in range(3):
        for m in (ref, model):
            m(batch_for_step(step)).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(isinstance(g, OffloadedGradient) for g in grads)  # no gradient in RAM
        assert opt.tier_stats()["parameters"]["kept_grad_bytes"] == (step + 1) * sum(
            p.numel() * 4 for p in model.parameters()
        )
        with pytest.raises(GradientOffloadedError, match="GradScaler"):
            grads[0].add_(1.0)
        for kwargs in ({"norm_type": float("inf")}, {"foreach": True}, {}):
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, **kwargs)
            got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, **kwargs)
            assert torch.equal(got, want), kwargs  # clipped thrice: norms read back after one
        assert torch.equal(
            opt.clip_grad_norm_(0.01), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        )
        for o in (plain, opt):
            o.step()
        opt.zero_grad(set_to_none=False)  # kept gradients are dropped, never zeroed in place
        plain.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    opt.close()
    assert_same_params(ref, model)


def test_model_zero_grad_between_backward_passes_drops_the_kept_gradients(tmp_path: Path) -> None:
    ref, model, plain, opt = _streaming(tmp_path)
    for step in range(3):
        for m, o in ((ref, plain), (model, opt)):
            m(batch_for_step(10 * step)).square().mean().backward()
            m.zero_grad()  # the model's, not the optimizer's: the next pass starts afresh
            m(batch_for_step(10 * step + 1)).square().mean().backward()
            m(batch_for_step(10 * step + 2)).square().mean().backward()  # accumulates
            o.step()
    opt.close()
    assert_same_params(ref, model)


def test_clip_grad_norm_without_streaming_is_torchs(tmp_path: Path) -> None:
    ref, model = make_models()
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    opt = SwapOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=tmp_path, **KWARGS)
    for step in range(3):
        for m in (ref, model):
            m(batch_for_step(step)).square().mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        assert torch.equal(opt.clip_grad_norm_(0.01), norm)
        for o in (plain, opt):
            o.step()
            o.zero_grad()
    opt.close()
    assert_same_params(ref, model)


def _two_layers(
    tmp_path: Path,
    width: int,
    *,
    host_budget: int,
    watch: Callable[[torch.nn.Module], None] = lambda model: None,
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, SwapOptimizer, torch.Tensor]:
    """Linear(width, 3/4 width) and Linear(3/4 width, 4), a copy of them, torch's AdamW on the
    first and a streaming SwapOptimizer within ``host_budget`` on the copy (which ``watch``
    sees first), and a batch of two inputs."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(width, width * 3 // 4), torch.nn.Linear(width * 3 // 4, 4)
    )
    model = copy.deepcopy(ref)
    watch(model)
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=host_budget,
        offload_parameters=True, **KWARGS,
    )  # fmt: skip
    return ref, model, plain, opt, torch.randn(2, width)


def test_a_gradient_larger_than_the_room_beside_resident_slices_is_kept(tmp_path: Path) -> None:
    """A 48 MiB gradient, with half of a 64 MiB host budget holding resident slices and the
    other half kept for slices in flight: the gradient goes to the store a slice at a time."""
    ref, model, plain, opt, x = _two_layers(tmp_path, 4096, host_budget=64 << 20)
    for _ in range(2):
        for m, o in ((ref, plain), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert opt.placement  # some slices stay resident
    assert len(opt.placement) < len(opt.slices)  # the others stream
    opt.close()
    assert_same_params(ref, model)


def test_a_step_in_backward_holds_no_gradient_for_slices_that_step_after_it(
    tmp_path: Path,
) -> None:
    """A weight whose slices are partly resident (they step in ``step()``, from the gradient
    kept in their tensors) and partly streamed (they speculate in backward with the gradient
    in memory): once the streamed ones have stepped, nothing holds the gradient through the
    rest of backward, which would be a whole gradient beyond the budgets. Bitwise as torch."""
    grads: list[Any] = []  # autograd's gradients, as accumulated (before the optimizer's hook)

    def watch(model: torch.nn.Module) -> None:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: grads.append(weakref.ref(p.grad)))

    ref, model, plain, opt, x = _two_layers(tmp_path, 1024, host_budget=8 << 20, watch=watch)
    for step in range(4):
        grads.clear()
        for m, o in ((ref, plain), (model, opt)):
            m(x).square().mean().backward()
            if o is opt and step:  # from the second step on, slices speculate in backward
                assert len(grads) == 4
                assert all(grad() is None for grad in grads)
            o.step()
            o.zero_grad()
    assert 0 < len(opt.placement) < len(opt.slices)
    assert opt.tier_stats()["schedule"]["speculated"] > 0
    opt.close()
    assert_same_params(ref, model)


class _Random(torch.nn.Module):
    """Linear layers of random widths, one of them frozen, with LayerNorms between."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        widths = [8] + [rng.choice([16, 96, 700]) for _ in range(rng.randint(2, 4))] + [4]
        layers: list[torch.nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [torch.nn.Linear(a, b), torch.nn.LayerNorm(b)]
        self.layers = torch.nn.ModuleList(layers)
        frozen = rng.randrange(len(layers))
        for p in self.layers[frozen].parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize(
    "seed",
    [seed if seed < 2 else pytest.param(seed, marks=pytest.mark.slow) for seed in range(SEEDS)],
)  # two in make test, the rest with the slow tests
def test_random_training_schedules_match_torch(tmp_path: Path, seed: int) -> None:
    """Random models, budgets, policies, backward passes per step, clipping, evaluations,
    model.zero_grad() between passes, commits and state dicts: in lock-step with torch."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ref = _Random(rng)
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **KWARGS)
    budget = rng.choice([20480, 65536, 256 << 10, None])
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=budget,
        policy=rng.choice(["lookahead", "lru"]), overlap=rng.choice(["auto", None, "forward"]),
        device_budget=rng.choice([0, 0, 30_000, 1 << 20]),
        commit_every=rng.choice([0, 1, 3]), offload_parameters=True, **KWARGS,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for step in range(5):
        passes = rng.randint(1, 3)
        for p in range(passes):
            x = torch.randn(3, 8, generator=gen)
            if p and rng.random() < 0.3:  # a pass thrown away
                for m in (ref, model):
                    m.zero_grad()
            for m in (ref, model):
                m(x).square().mean().backward()
        clip = rng.choice([None, 0.01, 100.0])
        if clip is not None:
            assert torch.equal(
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip),
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip),
            )
        for o in (plain, opt):
            o.step()
            o.zero_grad()
        if rng.random() < 0.5:
            x = torch.randn(2, 8, generator=gen)
            with torch.no_grad():
                assert torch.equal(ref(x), model(x)), step
        if rng.random() < 0.3:
            opt.commit()
        if rng.random() < 0.3:
            _same_state_dicts(ref, model)
        assert _held(model) == opt.tier_stats()["parameters"]["kept_bytes"]
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize(
    "device_budget", [0, 17_000, 40_000, 1 << 20], ids=["none", "tight", "some", "all"]
)
def test_device_budget_keeps_the_parameters_used_next(tmp_path: Path, device_budget: int) -> None:
    """``device_budget`` holds parameters between uses, those used soonest first (Belady on the
    order recorded over the first iteration); the step updates the kept ones in place, and
    what is kept is read no more. The budget holds the parameters in use too: those with
    values never exceed it, unless one module's own (with the root's ``scale``) do."""
    ref, model, plain, opt = _streaming(tmp_path, device_budget=device_budget)
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = 4 * (64 * 64 + 64) + 16  # mid's parameters, beside the root's scale
    fetched = []
    for step in range(4):
        norm = _train(ref, plain, step, 0.5)
        assert torch.equal(_train(model, opt, step, 0.5), norm)
        stats = opt.tier_stats()["parameters"]
        assert stats["kept_bytes"] <= device_budget
        assert stats["peak_bytes"] <= max(device_budget, largest)
        assert _held(model) == stats["kept_bytes"]
        fetched.append(stats["fetched_bytes"])
    per_step = fetched[-1] - fetched[-2]
    if device_budget == 0:
        assert per_step >= 2 * total  # forward and backward read every parameter
    elif device_budget >= total:
        assert per_step == 0  # everything stays
        assert fetched[1] == fetched[0]  # from the first iteration on, which records the order
    else:
        assert 0 < per_step < 2 * total
    _same_state_dicts(ref, model)
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("overlap", [None, "backward"])
@pytest.mark.parametrize("tier", ["host", "device"])
def test_resident_slices_beside_kept_parameters_start_from_the_newest_masters(
    tmp_path: Path, overlap: str | None, tier: str
) -> None:
    """Slices resident in host memory (a host budget that holds the state) or in what the
    parameters leave of ``device_budget``, beside parameters kept between uses, under
    schedules whose first step lets the kept masters lag (no commit): a resident slice reads
    its master once, on its first resident pass, and that must be the step's newest, not the
    stored one from before it. Bitwise torch's AdamW; it used to lose the first step."""
    settings = RESIDENT_IN[tier]
    ref, model, plain, opt = _streaming(tmp_path, overlap=overlap, commit_every=0, **settings)
    assert set(opt.placement.values()) == {tier}
    for step in range(4):
        _train(ref, plain, step)
        _train(model, opt, step)
        _same_state_dicts(ref, model)
    assert opt.tier_stats()["parameters"]["kept_bytes"] == ALL_KEPT  # all kept between uses
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("tier", ["host", "device"])
def test_resident_slices_speculate_after_a_commit_and_redo_from_the_store(
    tmp_path: Path, tier: str
) -> None:
    """Resident slices (in host memory, or in what the kept parameters leave of
    ``device_budget``) step in backward, speculatively, where the step before committed: the
    store then holds their pre-step state, and a redo (clipping that triggers) reads it back
    into their tensors. A parameter edited between steps changes its resident master, which
    the store lacks: its slices step after backward in that step. Bitwise torch's AdamW."""
    settings = RESIDENT_IN[tier]
    ref, model, plain, opt = _streaming(tmp_path, commit_every=1, **settings)
    assert set(opt.placement.values()) == {tier}
    edited = {p.index for p in opt.slices if any(s.param is model.mid.weight for s in p.slots)}
    for step, clip in enumerate([1000.0, 1000.0, 0.05, 1000.0, 0.05, 1000.0]):
        if step == 4:  # a clipped step: the others are redone
            with torch.no_grad():
                ref.mid.weight.mul_(0.5)
                model.mid.weight.mul_(0.5)
        _train(ref, plain, step, clip)
        _train(model, opt, step, clip)
        _same_state_dicts(ref, model)
    schedule = opt.tier_stats()["schedule"]
    slices = len(opt.slices)
    assert schedule["speculated"] == 5 * slices - len(edited)  # from the second step on
    assert schedule["redone"] == 2 * slices - len(edited)
    opt.close()
    assert_same_params(ref, model)


def test_a_commit_leaves_the_gradients_kept_in_resident_slices_unwritten(tmp_path: Path) -> None:
    """A resident slice holds its parameters' kept gradients, which each step refills: a
    commit writes its state and masters, not them. The run resumes from it bitwise."""
    ref, model = _pair()
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    settings = {"swap_dir": tmp_path, "host_budget": None, "offload_parameters": True}
    opt = SwapOptimizer(
        model, torch.optim.AdamW, overlap=None, commit_every=0, **settings, **KWARGS
    )
    assert len(opt.placement) == len(opt.slices)
    slot = next(s for s in opt.slices[0].slots if s.steps_from_kept_grad)
    grads = Region(slot.grad_key, 0, slot.param.numel())
    for step in range(3):
        _train(ref, plain, step, 0.5)
        _train(model, opt, step, 0.5)
    stored = opt._backend.read_region(grads)
    opt.commit()
    assert torch.equal(opt._backend.read_region(grads), stored)  # not written
    opt.close()
    _, fresh = _pair(seed=7)
    opt = SwapOptimizer(fresh, torch.optim.AdamW, resume=True, overlap=None, **settings, **KWARGS)
    for step in range(3, 5):
        _train(ref, plain, step, 0.5)
        _train(fresh, opt, step, 0.5)
    opt.close()
    assert_same_params(ref, fresh)


def test_the_device_budget_beyond_the_parameters_holds_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a GPU (the device tier is RAM) what the streamed parameters leave of
    ``device_budget`` holds resident slices: parameters and state share the budget, never
    more. On a GPU the device budget holds the parameters alone (state beside them there is
    not built)."""
    spare = 32768
    ref, model, plain, opt = _streaming(tmp_path / "cpu", device_budget=ALL_KEPT + spare)
    stats = opt.tier_stats()
    assert stats["parameters"]["budget"] == ALL_KEPT
    assert stats["device"]["budget"] == spare
    assert DEVICE in opt.placement.values()
    for step in range(3):
        _train(ref, plain, step, 0.5)
        _train(model, opt, step, 0.5)
        stats = opt.tier_stats()
        assert stats["device"]["peak"] <= spare
        assert stats["parameters"]["peak_bytes"] <= ALL_KEPT
    _same_state_dicts(ref, model)
    opt.close()
    monkeypatch.setattr(_assembly, "_device_tier_in_ram", lambda: False)  # as with a GPU
    _, _, _, on_gpu = _streaming(tmp_path / "gpu", device_budget=ALL_KEPT + spare)
    assert on_gpu.tier_stats()["parameters"]["budget"] == ALL_KEPT + spare
    assert DEVICE not in on_gpu.placement.values()
    on_gpu.close()


def test_gradients_that_stay_in_memory_take_no_room_in_resident_slices(tmp_path: Path) -> None:
    """``overlap="backward"`` with one backward pass a step: each gradient goes from backward
    to its slices' step in memory, never through the swap space, so a slice resident between
    steps holds its state and master alone, and the same budget keeps more of them resident
    than when passes accumulate (their gradients wait in the swap space). Bitwise torch's
    AdamW, within the budgets."""
    spare = 49152  # the device budget beyond the parameters: the tier of resident slices
    settings = {"overlap": "backward", "device_budget": ALL_KEPT + spare}
    ref, model, plain, opt = _streaming(tmp_path / "one", **settings)
    _, _, _, accumulating = _streaming(tmp_path / "two", accumulation_steps=2, **settings)
    held = [sum(p.held_bytes for p in o.slices) for o in (opt, accumulating)]
    numel = sum(p.numel() for p in model.parameters())
    assert held[0] <= held[1] - 4 * numel  # no gradient buffers (4 bytes an fp32 element)
    assert len(opt.placement) > len(accumulating.placement)
    accumulating.close()
    for step in range(4):
        _train(ref, plain, step)
        _train(model, opt, step)
        _same_state_dicts(ref, model)
        stats = opt.tier_stats()
        assert stats["device"]["peak"] <= spare
        assert stats["host"]["peak"] <= 20480
    opt.close()
    assert_same_params(ref, model)


def test_masters_that_lag_take_no_buffer_in_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept fp32 parameter is stepped in place; on a step that writes no master (no commit
    due, a schedule without rollbacks) its slice's job holds no buffer for the master, so the
    host budget's streaming part holds more slices in flight (a step that commits buffers it:
    the write copies the values there). Bitwise torch's AdamW."""
    lagging: list[tuple[Job, Job]] = []  # a job that lets its masters lag, and its twin
    make = _runner.slice_job

    def recording(piece: Any, *args: Any, masters_lag: bool = False, **kwargs: Any) -> Job:
        job = make(piece, *args, masters_lag=masters_lag, **kwargs)
        if masters_lag:
            lagging.append((job, make(piece, *args, **kwargs)))
        return job

    monkeypatch.setattr(_runner, "slice_job", recording)
    settings = {"overlap": "backward", "commit_every": 2, "host_budget": 49152}
    ref, model, plain, opt = _streaming(tmp_path, device_budget=ALL_KEPT, **settings)
    for step in range(4):
        _train(ref, plain, step)
        _train(model, opt, step)
        _same_state_dicts(ref, model)
    assert any(buffered.unread for _, buffered in lagging)
    for job, buffered in lagging:
        assert not job.unread
        assert job.reads == buffered.reads
        masters = sum(-(-4 * r.numel // 4096) * 4096 for r in buffered.unread)  # whole pages
        assert job.nbytes == buffered.nbytes - masters
    opt.close()
    assert_same_params(ref, model)


def test_backward_reads_ahead_the_slices_that_step_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepping in backward, the state reads started ahead are those of the slices that step
    next (backward steps the layout's order: the last parameters first), and ``step()`` starts
    those of the next step's first slices, which forward then hides; they used to be the
    slices that step last, which held the room until the end while each slice waited for its
    own read. Bitwise torch's AdamW."""
    events: list[tuple[str, list[int]]] = []
    work, prefetch = SliceRunner.work, Pipeline.prefetch

    def stepping(self: Any, plan: Any, job: Job, tensors: Any, **kwargs: Any) -> Any:
        events.append(("step", [job.name]))
        return work(self, plan, job, tensors, **kwargs)

    def reading(self: Pipeline, jobs: Any) -> None:
        jobs = list(jobs)
        events.append(("ahead", [job.name for job in jobs if isinstance(job.name, int)]))
        prefetch(self, jobs)

    monkeypatch.setattr(SliceRunner, "work", stepping)
    monkeypatch.setattr(Pipeline, "prefetch", reading)
    settings = {"overlap": "backward", "device_budget": ALL_KEPT, "host_budget": 98304}
    ref, model, plain, opt = _streaming(tmp_path, **settings)
    for step in range(3):
        events.clear()
        _train(ref, plain, step)
        _train(model, opt, step)
        _same_state_dicts(ref, model)
    stepped: list[int] = []
    for kind, names in events[:-1]:
        if kind == "step":
            stepped += names
        else:  # ahead of where backward stands, in the order it steps them
            assert names == sorted(names)
            assert all(name > max(stepped, default=-1) for name in names)
    assert stepped == sorted(stepped)
    assert events[-1][0] == "ahead"  # step() reads the first ones of the next step
    assert events[-1][1][0] == stepped[0]
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("device_budget", [0, ALL_KEPT], ids=["streamed", "kept"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_overlap_backward_steps_in_backward_without_keeping_the_gradients(
    tmp_path: Path, device_budget: int, accumulation: int
) -> None:
    """``overlap="backward"``: each slice steps in its gradient hook, with the gradients in
    memory; they are kept in the swap space only between the passes of an accumulating step,
    so a step reads them no more (against ``overlap=None``, in lock-step). Bitwise torch's
    AdamW without clipping; clipping after backward, which could change nothing, raises."""
    # slices that stream, with room for a module's reads beside a slice's (a tighter budget
    # drops reads started ahead to make room for the slices stepping in backward)
    settings = {
        "device_budget": device_budget,
        "accumulation_steps": accumulation,
        "host_budget": 49152,
    }
    ref, model, plain, opt = _streaming(tmp_path / "b", overlap="backward", **settings)
    _, other, _, after = _streaming(tmp_path / "n", overlap=None, **settings)
    numel = sum(p.numel() for p in model.parameters())
    read: list[tuple[int, int]] = []
    for step in range(4):
        for m, o in ((ref, plain), (model, opt), (other, after)):
            for part in range(accumulation):
                m(batch_for_step(2 * step + part)).square().mean().backward()
            o.step()
            o.zero_grad()
        read.append((_read(opt), _read(after)))
        _same_state_dicts(ref, model)
        _same_state_dicts(ref, other)
    kept = [o.tier_stats()["parameters"]["kept_grad_bytes"] for o in (opt, after)]
    assert kept == [4 * numel * 4 * (accumulation - 1), 4 * numel * 4 * accumulation]
    # over two steps (a step's count holds some reads the next one started ahead in step())
    in_backward, after_backward = (now - then for now, then in zip(read[-1], read[-3], strict=True))
    assert after_backward - in_backward > 4 * numel  # the gradients, read by the step
    model(batch_for_step(0)).square().mean().backward()
    with pytest.raises(GradientOffloadedError, match="overlap='backward'"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # the slices that stepped in backward, and the rest
    for o in (opt, after):
        o.close()


@pytest.mark.parametrize("clip", [1000.0, 0.05], ids=["clip-never", "clip-always"])
def test_kept_parameters_are_the_masters_their_steps_start_from(
    tmp_path: Path, clip: float
) -> None:
    """A parameter kept between uses holds its fp32 master's values: its slices' steps take
    the master from it instead of reading it. A step then reads the moments (and, where
    clipping makes it redo the slices or step after backward, the kept gradients), bitwise
    as in memory."""
    ref, model, plain, opt = _streaming(tmp_path, device_budget=ALL_KEPT)
    numel = sum(p.numel() for p in model.parameters())
    read, fetched = [], []
    for step in range(5):
        norm = _train(ref, plain, step, clip)
        assert torch.equal(_train(model, opt, step, clip), norm)
        read.append(_read(opt))
        fetched.append(opt.tier_stats()["parameters"]["fetched_bytes"])
    assert fetched == [4 * numel] * 5  # each read once, by its first use
    moments, grads = 2 * 4 * numel, 4 * numel
    needed = moments + (grads if clip < 1.0 else 0)
    # (small tensors are read in whole pages); reading the masters would add 4 * numel
    assert needed <= read[-1] - read[-2] < needed + 4 * numel
    _same_state_dicts(ref, model)
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("overlap", ["auto", "backward"])
def test_a_slice_stepping_in_backward_takes_its_master_from_the_parameter_in_use(
    tmp_path: Path, overlap: str
) -> None:
    """With nothing kept between uses, a parameter holds its values through its module's
    backward; its final gradient makes its slices step right there, and they take the master
    from those values before the stream frees them: a step reads the moments alone (its reads
    started ahead too), beside the parameters' own reads, bitwise as in memory."""
    ref, model, plain, opt = _streaming(tmp_path, host_budget=49152, overlap=overlap)
    numel = sum(p.numel() for p in model.parameters())
    moved = []
    for step in range(4):
        _train(ref, plain, step)
        _train(model, opt, step)
        moved.append(_read(opt) - opt.tier_stats()["parameters"]["fetched_bytes"])
        _same_state_dicts(ref, model)
    assert [b - a for a, b in itertools.pairwise(moved)][1:] == [2 * 4 * numel] * 2
    opt.close()
    assert_same_params(ref, model)


@pytest.mark.parametrize("overlap", ["backward", None])
@pytest.mark.parametrize("device_budget", [ALL_KEPT, 17_000], ids=["all-kept", "some-kept"])
def test_kept_masters_lag_until_a_commit_without_rollbacks(
    tmp_path: Path, overlap: str | None, device_budget: int
) -> None:
    """Under a schedule that never rolls back (``overlap=None`` or ``"backward"``) a step does
    not write the masters its kept parameters hold: a commit writes them, and so does a
    parameter that lets its values go (a tight ``device_budget``). Between commits a step
    writes the moments (and, under ``None``, the gradients) alone; the store keeps the last
    commit, from which a resume starts; training stays bitwise torch's."""
    settings = {"device_budget": device_budget, "overlap": overlap, "commit_every": 0}
    ref, model, plain, opt = _streaming(tmp_path, host_budget=49152, **settings)
    numel = sum(p.numel() for p in model.parameters())
    written = []
    for step in range(4):
        _train(ref, plain, step)
        _train(model, opt, step)
        _same_state_dicts(ref, model)  # a freed parameter's master was written when it left
        opt._backend.pipeline.drain()  # the last writes of a step end during the next one
        written.append(opt.tier_stats()["nvme"]["bytes_written"])
    needed = 2 * 4 * numel + (4 * numel if overlap is None else 0)  # moments (+ gradients)
    if device_budget == ALL_KEPT:  # every master lags: none is written
        assert needed <= written[-1] - written[-2] < needed + 4 * numel
    lagging = opt._parts.state.unwritten_masters
    assert any(lagging.values())
    opt.commit()
    assert not any(lagging.values())
    committed = {name: p.detach().clone() for name, p in ref.named_parameters()}
    for m, o in ((ref, plain), (model, opt)):  # a step after the commit, then a crash
        m(batch_for_step(4)).square().mean().backward()
        o.step()
    opt._parts.state.failed = True  # as a crash: the step is not committed
    with pytest.warns(RuntimeWarning, match="were not committed"):
        opt.close()
    _, fresh = _pair(seed=7)
    again = SwapOptimizer(
        fresh, torch.optim.AdamW, swap_dir=tmp_path, resume=True, offload_parameters=True,
        **KWARGS,
    )  # fmt: skip
    resumed = fresh.state_dict()  # the values of the commit, not of the step after it
    assert resumed.keys() == committed.keys()
    for name, value in committed.items():
        assert torch.equal(resumed[name], value), name
    again.close()


def test_kept_masters_lag_while_speculation_pauses_and_are_written_before_it_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``overlap="auto"`` a step that cannot speculate (clipping redid the last two, so
    speculation pauses) rolls nothing back: it writes no master its kept parameter holds, as
    ``"backward"`` does. The first speculative step after the pause writes them before its
    savepoint, so that a slice it redoes gets its parameter back from a current master (here
    clipping triggers in that step too). Bitwise torch's AdamW with the same clipping."""
    monkeypatch.setattr(_speculation, "FIRST_PAUSE", 2)
    settings = {"device_budget": ALL_KEPT, "commit_every": 0, "host_budget": 49152}
    ref, model, plain, opt = _streaming(tmp_path, **settings)
    numel = sum(p.numel() for p in model.parameters())
    clip = {1: 1e-3, 2: 1e-3, 5: 1e-3}  # triggers; 1e9 elsewhere (exactly 1.0: no redo)
    written, lagging, redone = [], [], []
    for step in range(7):
        _train(ref, plain, step, clip.get(step, 1e9))
        _train(model, opt, step, clip.get(step, 1e9))
        _same_state_dicts(ref, model)
        opt._backend.pipeline.drain()  # the last writes of a step end during the next one
        written.append(opt.tier_stats()["nvme"]["bytes_written"])
        lagging.append(any(opt._parts.state.unwritten_masters.values()))
        redone.append(opt.tier_stats()["schedule"]["redone"])
    schedule = opt.tier_stats()["schedule"]
    # steps 3 and 4 step after backward; step 5's redo pauses speculation again (step 6)
    assert schedule["paused_steps"] == 3
    assert redone[5] > redone[4]
    assert lagging[3]
    assert lagging[4]
    needed = 3 * 4 * numel  # the moments and the gradients (kept in the swap space)
    assert needed <= written[4] - written[3] < needed + 4 * numel  # no master
    assert not lagging[5]  # written before step 5's savepoint (and its redo)
    assert lagging[6]
    opt.close()
    assert_same_params(ref, model)


def test_a_commit_that_fails_leaves_the_masters_lagging_for_the_next(tmp_path: Path) -> None:
    """A commit whose writes fail raises and keeps the masters it was writing marked as
    lagging: the next commit writes them again, and a resume starts from its values."""
    settings = {"device_budget": ALL_KEPT, "overlap": "backward", "commit_every": 0}
    ref, model, plain, opt = _streaming(tmp_path, host_budget=49152, **settings)
    for step in range(3):
        for m, o in ((ref, plain), (model, opt)):
            m(batch_for_step(step)).square().mean().backward()
            o.step()
            o.zero_grad()
    opt._backend.pipeline.drain()
    lagging = dict(opt._parts.state.unwritten_masters)
    assert any(lagging.values())
    inject(opt._backend.store, fail={"write_file": {1}})
    with pytest.raises(OSError, match="Input/output error"):
        opt.commit()
    remove(opt._backend.store)
    assert opt._parts.state.unwritten_masters == lagging
    opt.close()  # commits
    _, fresh = _pair(seed=7)
    again = SwapOptimizer(
        fresh, torch.optim.AdamW, swap_dir=tmp_path, resume=True, offload_parameters=True,
        **KWARGS,
    )  # fmt: skip
    _same_state_dicts(ref, fresh)
    again.close()


def test_model_load_state_dict_writes_the_loaded_values_to_the_swap_space(
    tmp_path: Path,
) -> None:
    """``model.load_state_dict()`` (a trainer's resume) copies into each module's parameters
    while the module loads, and the loaded values become the masters: training goes on as
    torch's does after the same load, with resident slices and kept parameters too."""
    for name, settings in {
        "streamed": {"host_budget": 20480},
        "resident": {"host_budget": None, "device_budget": 1 << 20},
    }.items():
        ref, model, plain, opt = _streaming(tmp_path / name, **settings)
        for step in range(2):
            _train(ref, plain, step, 0.5)
            _train(model, opt, step, 0.5)
        _, other = _pair(seed=5)
        loaded = other.state_dict()
        del loaded["mid.bias"]  # a key the state dict lacks keeps its value
        ref.load_state_dict(loaded, strict=False)
        model.load_state_dict(loaded, strict=False)
        assert _held(model) == 0  # nothing holds values after the load
        _same_state_dicts(ref, model)
        for step in range(2, 4):
            _train(ref, plain, step, 0.5)
            _train(model, opt, step, 0.5)
        _same_state_dicts(ref, model)
        opt.close()
        assert_same_params(ref, model)


def _decay_groups(model: torch.nn.Module) -> list[dict[str, object]]:
    """Weight decay on the matrices only, as trainers group parameters."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def test_param_groups_stream_with_model_named(tmp_path: Path) -> None:
    """Param groups (weight decay on some parameters only) with ``model=``, through the
    constructor and through ``offload()``: bitwise torch's AdamW with the same groups."""
    ref, model = _pair()
    _, model2 = _pair()
    plain = torch.optim.AdamW(_decay_groups(ref), lr=1e-2)
    opt = SwapOptimizer(
        _decay_groups(model), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "a",
        host_budget=20480, offload_parameters=True, model=model,
    )  # fmt: skip
    opt2 = offload(
        torch.optim.AdamW(_decay_groups(model2), lr=1e-2), swap_dir=tmp_path / "b",
        host_budget=20480, offload_parameters=True, model=model2,
    )  # fmt: skip
    for step in range(4):
        _train(ref, plain, step, 0.5)
        _train(model, opt, step, 0.5)
        _train(model2, opt2, step, 0.5)
        assert _held(model) == _held(model2) == 0
    _same_state_dicts(ref, model)
    _same_state_dicts(ref, model2)
    opt.close()
    opt2.close()


def test_muon_for_the_matrices_beside_adamw_streams(tmp_path: Path) -> None:
    """Muon's groups step whole matrices: streamed, they match the optimizer that does not
    stream."""
    ref, model = _pair()

    plain = SwapOptimizer(muon_groups(ref), torch.optim.AdamW, swap_dir=tmp_path / "a", **KWARGS)
    opt = SwapOptimizer(
        muon_groups(model), torch.optim.AdamW, swap_dir=tmp_path / "b", host_budget=160 << 10,
        offload_parameters=True, model=model, **KWARGS,
    )  # fmt: skip
    for step in range(4):
        _train(ref, plain, step, 0.5)
        _train(model, opt, step, 0.5)
    _same_state_dicts(ref, model)
    plain.close()
    opt.close()


def test_groups_and_model_that_do_not_match_are_refused(tmp_path: Path) -> None:
    _, model = _pair()
    _, other = _pair()
    with pytest.raises(ConfigError, match="needs offload_parameters=True"):
        SwapOptimizer(model.parameters(), swap_dir=tmp_path / "a", model=model)
    with pytest.raises(ConfigError, match="names another one"):
        SwapOptimizer(model, swap_dir=tmp_path / "b", offload_parameters=True, model=other)
    with pytest.raises(ConfigError, match="not parameters of the model"):
        SwapOptimizer(
            [*model.parameters(), *other.out.parameters()], swap_dir=tmp_path / "c",
            offload_parameters=True, model=model,
        )  # fmt: skip
    assert _held(model) > 0  # refused before anything was freed


@pytest.mark.parametrize("host_budget", [20480, None], ids=["streamed", "resident"])
def test_grad_scaler_unscales_clips_and_skips_steps_as_torch(
    tmp_path: Path, host_budget: int | None
) -> None:
    """A ``GradScaler`` (the CPU one here): its unscale checks the kept gradients for inf and
    NaN and records its factor; a step whose gradients overflowed is skipped and the scale
    backs off, as with the gradients in memory; then clipping: bitwise torch's AdamW."""
    ref, model, plain, opt = _streaming(tmp_path, host_budget=host_budget)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in "ab"]
    for step in range(6):
        for m, o, scaler in ((ref, plain, scalers[0]), (model, opt, scalers[1])):
            loss = m(batch_for_step(step)).square().mean()
            if step == 2:  # an overflow: every gradient is inf or NaN
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        _same_state_dicts(ref, model)
    assert opt.steps == 5  # the overflowed step was skipped
    opt.close()


def test_the_step_runs_into_the_next_forward_which_the_worker_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``overlap="forward"``: ``step()`` returns before the slices step; the next forward's
    modules wait each for their own parameters, whose reads the step's worker runs between its
    slices (the pipeline has one user at a time). Clipping triggers in some steps (redone
    slices); reads ahead of the next modules' parameters start once their slices have
    stepped; a model state dict taken right after ``step()`` holds the stepped values; every
    step bitwise torch's."""
    read_after_step: list[int] = []  # parameters read ahead once their slices stepped
    stepped = ReadsAhead.stepped

    def counting(ahead: ReadsAhead) -> None:
        waiting = set(ahead._after_step)
        stepped(ahead)
        read_after_step.append(len(waiting - ahead._after_step))

    monkeypatch.setattr(ReadsAhead, "stepped", counting)
    ref, model, plain, opt = _streaming(tmp_path, overlap="forward", commit_every=2)
    deferred = opt._deferred
    served: list[bool] = []  # for each hook call: whether it ran on the worker
    serve = deferred.serve

    def recording(call: Callable[[], Any]) -> Any:
        def wrapped() -> Any:
            served.append(threading.get_ident() == deferred._worker)
            return call()

        return serve(wrapped)

    monkeypatch.setattr(deferred, "serve", recording)
    pending_after_step = []
    for step in range(6):
        clip = 0.05 if step % 2 else 1000.0
        for m, o in ((ref, plain), (model, opt)):
            m(batch_for_step(step)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()
            if o is opt:
                pending_after_step.append(any(deferred.pending(p) for p in model.parameters()))
            o.zero_grad()
        if step == 3:
            _same_state_dicts(ref, model)  # waits for the parameters it reads
        x = batch_for_step(100 + step)
        with torch.no_grad():
            assert torch.equal(ref(x), model(x))  # the forward the step runs into
    assert any(pending_after_step[1:])  # step() returned with slices still to step
    assert sum(read_after_step) > 0
    assert any(served)  # hooks served by the worker
    assert not all(served)  # and on their own thread once no step runs
    opt.synchronize()
    assert not deferred.busy
    assert _held(model) == 0
    schedule = opt.tier_stats()["schedule"]
    assert schedule["redone"] > 0
    assert schedule["speculated"] > 0
    opt.close()
    assert_same_params(ref, model)


def test_a_failed_read_in_a_step_into_the_forward_is_raised_and_leaves_nothing_held(
    tmp_path: Path,
) -> None:
    """A read that fails while the step runs into the forward fails that step: the forward
    that waits for it raises (nothing deadlocks, no parameter keeps memory), the step is not
    counted, and the optimizer refuses to commit it; ``close()`` still returns the model."""
    _, model, _, opt = _streaming(tmp_path, overlap="forward")
    for step in range(2):
        _train(model, opt, step, 1.0)
    model(batch_for_step(2)).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # every slice steps again
    store = opt._backend.store
    inject(store, fail={"read_file": set(range(1, 1000))})
    opt.step()  # returns: the slices step on the worker
    assert opt._deferred.busy
    x = batch_for_step(3)
    with pytest.raises(OSError, match="Input/output error"):
        model(x)
    remove(store)
    assert not opt._deferred.busy
    opt.synchronize()  # raised once, by the forward
    assert opt.steps == 2  # the failed step is not counted
    assert _held(model) == 0
    with pytest.warns(RuntimeWarning, match="not committed"):
        opt.close()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
