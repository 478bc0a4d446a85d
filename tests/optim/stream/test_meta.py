"""Models built on the meta device (``offload_parameters=True`` with ``param_init_fn``): the
parameters get their first values in the swap space, one module's init at a time, equal to
the model built in memory from the same seed, and training from there is bitwise torch's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.optim.models import batch_for_step
from tests.optim.stream.lockstep import train_gpt2_lockstep
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer

KWARGS = {"lr": 1e-2, "weight_decay": 0.05}


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.lin = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)  # buffers: reset_parameters resets them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.lin(self.norm(x))))


class Deep(torch.nn.Module):
    """Nested modules of torch layers, with buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.Sequential(Block(32), Block(32))
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _built(build: Callable[[], torch.nn.Module], meta: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if not meta:
        return build()
    with torch.device("meta"):
        return build()


def _same_state_dicts(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert torch.equal(value, sb[key]), key


def _held(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_torch_layers_start_as_built_in_memory_and_train_bitwise(tmp_path: Path) -> None:
    ref = _built(Deep, meta=False)
    model = _built(Deep, meta=True)
    params = list(model.parameters())
    torch.manual_seed(0)  # the seed the model in memory was built from
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=20480,
        offload_parameters=True, **KWARGS,
    )  # fmt: skip
    assert list(model.parameters()) == params  # the same objects, placed in place
    assert _held(model) == 0
    assert all(not b.is_meta for b in model.buffers())
    _same_state_dicts(ref, model)
    plain = torch.optim.AdamW(ref.parameters(), **KWARGS)
    for step in range(4):
        for m, o in ((ref, plain), (model, opt)):
            x = batch_for_step(step).repeat(2, 1)[:, :8]
            m(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
    _same_state_dicts(ref, model)
    opt.close()


def _gpt2(meta: bool) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=97, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return _built(lambda: transformers.GPT2LMHeadModel(config), meta=meta).train()


def test_gpt2_initialized_by_its_init_weights_one_module_at_a_time(tmp_path: Path) -> None:
    """GPT-2's init rescales each block's ``c_proj`` weights from the parent module, after the
    child's own init: the parent's call reads the child's master back. Equal to the model in
    memory re-initialized by ``apply(_init_weights)`` from the same seed; memory holds at most
    one block's parameters at a time."""
    ref = _gpt2(meta=False)
    torch.manual_seed(1)
    ref.apply(ref._init_weights)
    model = _gpt2(meta=True)
    blocks = [*model.transformer.h, model.transformer.wte, model.transformer.wpe]
    largest = max(sum(p.numel() * 4 for p in block.parameters()) for block in blocks)
    held: list[int] = []

    def init(module: torch.nn.Module) -> None:
        model._init_weights(module)
        with torch._C.DisableTorchFunction():  # a look that brings no parameter in
            held.append(_held(model))

    torch.manual_seed(1)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=20480,
        offload_parameters=True, param_init_fn=init,
    )  # fmt: skip
    assert len(held) == len(list(model.modules()))
    assert 0 < max(held) <= largest
    _same_state_dicts(ref, model)
    plain = torch.optim.AdamW(ref.parameters())
    train_gpt2_lockstep([(ref, plain), (model, opt)], 5)
    _same_state_dicts(ref, model)
    opt.close()


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_bf16_parameters_get_masters_of_their_first_values(tmp_path: Path, master: str) -> None:
    def build() -> torch.nn.Module:  # built in bf16: whether torch draws a bf16 init as it
        # draws an fp32 one and casts it depends on its version
        bf16 = torch.bfloat16
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16, dtype=bf16), torch.nn.Linear(16, 4, dtype=bf16)
        )

    ref = _built(build, meta=False)
    model = _built(build, meta=True)
    torch.manual_seed(0)
    plain = SwapOptimizer(ref, torch.optim.AdamW, swap_dir=tmp_path / "a", master=master, **KWARGS)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path / "b", offload_parameters=True,
        master=master, **KWARGS,
    )  # fmt: skip
    for step in range(3):
        for m, o in ((ref, plain), (model, opt)):
            m(batch_for_step(step).bfloat16()).float().square().mean().backward()
            o.step()
            o.zero_grad()
    _same_state_dicts(ref, model)
    plain.close()
    opt.close()


def test_a_resume_takes_the_parameters_from_the_folder_and_inits_the_buffers(
    tmp_path: Path,
) -> None:
    settings = {"swap_dir": tmp_path, "host_budget": 20480, "offload_parameters": True}
    model = _built(Deep, meta=True)
    opt = SwapOptimizer(model, torch.optim.AdamW, **settings, **KWARGS)
    for step in range(2):
        model(batch_for_step(step).repeat(2, 1)[:, :8]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    trained = {name: value.clone() for name, value in model.state_dict().items()}
    opt.close()
    assert all(p.is_meta for p in model.parameters())  # too large for memory: back to meta
    fresh = _built(Deep, meta=True)

    opt = SwapOptimizer(fresh, torch.optim.AdamW, resume=True, **settings, **KWARGS)
    resumed = fresh.state_dict()  # fills the streamed values in
    for name, _ in fresh.named_parameters():
        assert torch.equal(trained[name], resumed[name]), name
    for block in fresh.blocks:  # the init ran for the buffers, whose values are not stored
        assert torch.equal(block.bn.running_var, torch.ones(32))
    assert _held(fresh) == 0
    opt.close()


class Bare(torch.nn.Module):
    """A parameter of its own and no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.gain = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


def test_what_cannot_be_initialized_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no reset_parameters"):
        SwapOptimizer(_built(Bare, meta=True), swap_dir=tmp_path / "a", offload_parameters=True)

    def only_linear(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()

    model = _built(Bare, meta=True)
    with pytest.raises(ConfigError, match=r"\['gain'\].*no init function gave them values"):
        SwapOptimizer(
            model, swap_dir=tmp_path / "b", offload_parameters=True, param_init_fn=only_linear
        )
    assert all(p.is_meta for p in model.parameters())  # as it came: a corrected call works

    def init(module: torch.nn.Module) -> None:
        if isinstance(module, Bare):
            torch.nn.init.ones_(module.gain)
        else:
            only_linear(module)

    opt = SwapOptimizer(
        model, swap_dir=tmp_path / "b2", offload_parameters=True, param_init_fn=init
    )
    assert torch.equal(model.state_dict()["gain"], torch.ones(4))
    opt.close()

    def replace(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(torch.zeros(4, 4))

    with pytest.raises(ConfigError, match="replaced parameters"):
        SwapOptimizer(
            _built(Bare, meta=True), swap_dir=tmp_path / "e", offload_parameters=True,
            param_init_fn=replace,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="built on the meta device"):
        SwapOptimizer(_built(Bare, meta=True), swap_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="needs offload_parameters=True"):
        SwapOptimizer(_built(Bare, meta=False), swap_dir=tmp_path / "d", param_init_fn=print)
