"""offload() and swapped(): the two adapters around SwapOptimizer."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batches,
    groups,
    make_models,
    train_step,
)
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer, offload, swapped
from tierswap.optim._config import SwapConfig


def test_offload_keeps_class_groups_and_state() -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.RMSprop(groups(plain_model, lr=2e-3), lr=1e-2, momentum=0.5)
    existing = torch.optim.RMSprop(groups(swap_model, lr=2e-3), lr=1e-2, momentum=0.5)
    data = batches(5)
    for x in data[:2]:
        train_step(plain_model, plain, x)
        train_step(swap_model, existing, x)
    swap = offload(existing, host_budget="1MiB")
    with swap:
        assert isinstance(swap, SwapOptimizer)
        assert type(swap._inner) is torch.optim.RMSprop
        assert not existing.state  # moved, not copied
        assert swap.param_groups[1]["lr"] == 2e-3
        for x in data[2:]:
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())


def test_offload_with_too_small_a_budget_leaves_the_optimizer_intact() -> None:
    _, model = make_models()
    existing = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, existing, batches(1)[0])
    before = {k: dict(v) for k, v in existing.state.items()}
    with pytest.raises(ConfigError, match="minimum"):
        offload(existing, host_budget=1)
    assert existing.state.keys() == before.keys()
    train_step(model, existing, batches(2)[1])  # still usable


def test_offload_rejects_non_optimizers() -> None:
    with pytest.raises(ConfigError, match=r"torch\.optim\.Optimizer") as raised:
        offload(object())
    assert isinstance(raised.value, TypeError)  # what offload() raised before
    _, model = make_models()
    with SwapOptimizer(model.parameters()) as swap, pytest.raises(ConfigError, match="already"):
        offload(swap)


def test_offload_names_keywords_that_are_not_settings() -> None:
    _, model = make_models()
    existing = torch.optim.Adam(model.parameters())
    with pytest.raises(ConfigError, match=r"\['lr'\] are not SwapOptimizer settings"):
        offload(existing, lr=1e-3, host_budget="1MiB")


def test_the_settings_are_listed_once_per_place_and_documented() -> None:
    """The constructor's keywords are SwapConfig's fields, in order, each in the docstring."""
    signature = inspect.signature(SwapOptimizer.__init__).parameters.values()
    keywords = [p.name for p in signature if p.kind is inspect.Parameter.KEYWORD_ONLY]
    fields = [field.name for field in dataclasses.fields(SwapConfig)]
    assert keywords == fields
    doc = SwapOptimizer.__doc__ or ""
    documented = {
        name.strip() for line in re.findall(r"^    (\w[\w, ]*):$", doc, re.M)
        for name in line.split(",")
    }  # fmt: skip
    assert set(fields) <= documented, sorted(set(fields) - documented)
    for name in fields:  # the defaults agree too
        default = inspect.signature(SwapOptimizer.__init__).parameters[name].default
        assert default == SwapConfig.__dataclass_fields__[name].default, name


def test_swapped_class_is_a_constructible_optimizer_class() -> None:
    plain_model, swap_model = make_models()
    cls = swapped(torch.optim.Adamax)
    assert issubclass(cls, torch.optim.Optimizer)
    assert cls.__name__ == "SwappedAdamax"
    plain = torch.optim.Adamax(plain_model.parameters(), lr=1e-2)
    with cls(swap_model.parameters(), lr=1e-2, host_budget="64KiB") as swap:
        for x in batches(3):
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        assert_same_params(plain_model, swap_model)


def test_lr_scheduler_accepts_it() -> None:
    _, model = make_models()
    with swapped(torch.optim.SGD)(model.parameters(), lr=1.0) as swap:
        sched = torch.optim.lr_scheduler.LambdaLR(swap, lambda epoch: 0.5**epoch)
        train_step(model, swap, batches(1)[0])
        sched.step()
        assert swap.param_groups[0]["lr"] == 0.5


# importing torch.distributed.optim uses the deprecated torch.jit.script and .interface
@pytest.mark.filterwarnings(
    "ignore:`torch.jit.(script|interface)` is deprecated:DeprecationWarning"
)
def test_swapped_as_zero_redundancy_optimizer_class(tmp_path) -> None:
    """torch's ZeroRedundancyOptimizer builds it per rank; the rank gets swap_dir/rank-<r>."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    init = f"file://{tmp_path / 'pg'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        plain_model, swap_model = make_models()
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        zero = ZeroRedundancyOptimizer(
            swap_model.parameters(), optimizer_class=swapped(torch.optim.AdamW),
            swap_dir=tmp_path / "swap", host_budget="1MiB", lr=1e-2,
        )  # fmt: skip
        for x in batches(3):
            train_step(plain_model, plain, x)
            train_step(swap_model, zero, x)
        assert_same_params(plain_model, swap_model)
        assert zero.optim.swap_dir == tmp_path / "swap" / "rank-0"
        zero.consolidate_state_dict(0)
        consolidated = zero.state_dict()  # its groups also carry swap_dir and host_budget
        expected = {**plain.state_dict(), "param_groups": consolidated["param_groups"]}
        assert_same_state(expected, consolidated)
        zero.optim.close()
    finally:
        dist.destroy_process_group()
