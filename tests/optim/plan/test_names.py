"""Swap keys from parameter names; resume by name; positional folders keep working."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from tests.optim.models import TinyNet, batches, make_models
from tierswap.errors import ConfigError
from tierswap.keys import validate_key
from tierswap.optim import SwapOptimizer
from tierswap.optim.plan._names import key_prefix, name_of
from tierswap.store import SwapStore


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_named_parameters_give_named_keys(tmp_path: Path) -> None:
    _, model = make_models()
    with SwapOptimizer(model.named_parameters(), lr=1e-2, swap_dir=tmp_path / "s") as opt:
        _train(model, opt, batches(2))
    with SwapStore(tmp_path / "s", mode="r") as store:
        keys = set(store.keys())
        meta = store.meta["tierswap.optim"]
    assert {"inp.weight/exp_avg", "inp.weight/exp_avg_sq", "inp.weight/param"} <= keys
    assert "mid.bias/exp_avg" in keys
    assert not any(k.startswith("p0/") for k in keys)
    assert meta["names"] == [n for n, _ in model.named_parameters()]
    group = zarr.open_group(tmp_path / "s", mode="r")  # another tool sees the names too
    raw = np.asarray(group["inp.weight/exp_avg"][:])
    assert raw.shape == (model.inp.weight.numel(),)


def test_without_names_keys_stay_positional(tmp_path: Path) -> None:
    _, model = make_models()
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s") as opt:
        _train(model, opt, batches(1))
    with SwapStore(tmp_path / "s", mode="r") as store:
        assert "p1/exp_avg" in store  # p0, the unused parameter, has no state


class Reordered(TinyNet):
    """TinyNet whose parameters register in another order (same names, same shapes)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.unused = torch.nn.Parameter(torch.randn(5))
        self.out = torch.nn.Linear(24, 4)
        self.mid = torch.nn.Linear(24, 24)
        self.inp = torch.nn.Linear(8, 24)


def test_resume_matches_by_name_after_the_order_changed(tmp_path: Path) -> None:
    reference, model = make_models()
    xs = batches(4)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(reference, plain, xs)
    opt = SwapOptimizer(model.named_parameters(), lr=1e-2, swap_dir=tmp_path / "s")
    _train(model, opt, xs[:2])
    opt.close()  # as if the run stopped here
    moved = Reordered()  # a new process: parameters come back from the swap folder
    with SwapOptimizer(
        moved.named_parameters(), lr=1e-2, swap_dir=tmp_path / "s", resume=True
    ) as resumed:
        assert resumed.steps == 2
        _train(moved, resumed, xs[2:])
    for name, param in reference.named_parameters():
        assert torch.equal(param, moved.get_parameter(name)), name


def test_resume_names_missing_and_unexpected_parameters(tmp_path: Path) -> None:
    _, model = make_models()
    with SwapOptimizer(model.named_parameters(), swap_dir=tmp_path / "s") as opt:
        _train(model, opt, batches(1))
    other = torch.nn.Linear(8, 24)
    named = [("inp.weight", other.weight), ("extra.bias", other.bias)]
    with pytest.raises(
        ConfigError, match=r"missing here \[.*'mid.weight'.*\], not in the folder \['extra.bias'\]"
    ):
        SwapOptimizer(named, swap_dir=tmp_path / "s", resume=True)
    with SwapStore(tmp_path / "s", mode="r") as store:  # the folder is as it was
        assert store.generation == 1


def test_a_positional_folder_resumes_with_named_parameters(tmp_path: Path) -> None:
    reference, model = make_models()
    xs = batches(3)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), xs)
    opt = SwapOptimizer(model.parameters(), lr=1e-2, swap_dir=tmp_path / "s")  # no names
    _train(model, opt, xs[:2])
    opt.close()
    _, fresh = make_models(seed=5)
    with SwapOptimizer(
        fresh.named_parameters(), lr=1e-2, swap_dir=tmp_path / "s", resume=True
    ) as resumed:
        _train(fresh, resumed, xs[2:])
        assert "p1/exp_avg" in resumed._backend.store  # the folder keeps its keys
    for a, b in zip(reference.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "name",
    ["layer.0.weight", "a/b", "50%", "back\\slash", "tab\there", "zarr.json", ".tierswap", ".",
     "..", "optim", "é.weight"],
)  # fmt: skip
def test_names_the_key_rules_refuse_are_escaped_reversibly(name: str) -> None:
    prefix = key_prefix(name)
    validate_key(f"{prefix}/exp_avg")
    assert name_of(prefix) == name
    assert prefix == name or "%" in prefix


def test_overlong_names_are_shortened_and_kept_in_the_commit(tmp_path: Path) -> None:
    long = "block." * 60 + "weight"
    prefix = key_prefix(long)
    validate_key(f"{prefix}/exp_avg")
    assert prefix != key_prefix(long[:-1] + "x")  # distinct names stay distinct
    param = torch.nn.Parameter(torch.randn(3))
    param.grad = torch.randn(3)
    with SwapOptimizer([(long, param)], swap_dir=tmp_path / "s") as opt:
        opt.step()
    with SwapStore(tmp_path / "s", mode="r") as store:
        assert store.meta["tierswap.optim"]["names"] == [long]


def test_one_name_twice_is_refused() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="occur twice"):
        SwapOptimizer([{"params": [("w", a)]}, {"params": [("w", b)]}])


def _as_before_names(path: Path) -> None:
    """Rewrite a positional folder's bookkeeping as the optimizer wrote it before names: the
    scalar blob keyed by parameter index, no ``keys``/``names`` in the commit's metadata."""
    import io

    with SwapStore(path) as store:
        blob = torch.load(io.BytesIO(store.get("optim/small").numpy().tobytes()))
        for part in ("small", "names"):
            blob[part] = {int(k.removeprefix("p")): v for k, v in blob[part].items()}
        buffer = io.BytesIO()
        torch.save(blob, buffer)
        store.put("optim/small", torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
        meta = dict(store.meta)
        meta["tierswap.optim"] = {
            k: v for k, v in meta["tierswap.optim"].items() if k not in ("keys", "names", "time")
        }
        store.commit(meta)


def test_a_folder_from_before_names_still_resumes(tmp_path: Path) -> None:
    reference, model = make_models()
    xs = batches(3)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), xs)
    opt = SwapOptimizer(model.parameters(), lr=1e-2, swap_dir=tmp_path / "s")
    _train(model, opt, xs[:2])
    opt.close()
    _as_before_names(tmp_path / "s")
    _, fresh = make_models(seed=5)
    resumed = SwapOptimizer(fresh.named_parameters(), lr=1e-2, swap_dir=tmp_path / "s", resume=True)
    with resumed:
        assert resumed.steps == 2
        _train(fresh, resumed, xs[2:])
    for a, b in zip(reference.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def _named_groups(model: torch.nn.Module, split: int = 2, swap: bool = False) -> list[dict]:
    """The first ``split`` named parameters at lr 1e-2, the others at 1e-3; ``swap`` passes
    the two groups in the other order."""
    named = list(model.named_parameters())
    result: list[dict] = [
        {"params": [p for _, p in part], "param_names": [n for n, _ in part], "lr": lr}
        for part, lr in ((named[:split], 1e-2), (named[split:], 1e-3))
    ]
    return result[::-1] if swap else result


def test_resume_gives_each_group_its_hyper_parameters_by_name(tmp_path: Path) -> None:
    reference, model = make_models()
    xs = batches(4)
    _train(reference, torch.optim.AdamW(_named_groups(reference)), xs)
    opt = SwapOptimizer(_named_groups(model), swap_dir=tmp_path / "s", host_budget="64KiB")
    _train(model, opt, xs[:2])
    opt.close()
    _, fresh = make_models(seed=5)
    with SwapOptimizer(
        _named_groups(fresh, swap=True), swap_dir=tmp_path / "s", host_budget="64KiB", resume=True
    ) as resumed:
        lrs = [(g["param_names"][0], g["lr"]) for g in resumed.param_groups]
        assert lrs == [("inp.bias", 1e-3), ("unused", 1e-2)]
        _train(fresh, resumed, xs[2:])
    for name, param in reference.named_parameters():
        assert torch.equal(param, fresh.get_parameter(name)), name


@pytest.mark.parametrize("names", [True, False])
def test_resume_refuses_parameters_split_into_other_groups(tmp_path: Path, names: bool) -> None:
    _, model = make_models()

    def split_at(count: int) -> list[dict]:
        parts = _named_groups(model, split=count)
        if not names:
            for group in parts:
                del group["param_names"]
        return parts

    with SwapOptimizer(split_at(2), swap_dir=tmp_path / "s") as opt:
        _train(model, opt, batches(1))
    match = r"param groups.*'inp.weight'" if names else "param groups"
    with pytest.raises(ConfigError, match=match):
        SwapOptimizer(split_at(1), swap_dir=tmp_path / "s", resume=True)
    with SwapStore(tmp_path / "s", mode="r") as store:  # nothing written
        assert store.generation == 1
