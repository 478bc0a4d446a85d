"""The step's share of torch's CPU threads (tierswap._threads), and the step that uses it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import tierswap as ts
from tierswap._threads import _openmp, elementwise, kernel_threads, step_threads


@pytest.fixture
def four_threads() -> Iterator[None]:
    """Four torch threads on this thread (OpenMP allows more than the cores), restored after."""
    if not _openmp():
        pytest.skip("the step keeps torch's threads outside OpenMP")
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.usefixtures("four_threads")
def test_a_block_runs_on_half_the_threads_and_restores_them() -> None:
    assert kernel_threads() == 2
    with step_threads(True):
        assert torch.get_num_threads() == 2
        assert kernel_threads() == 2  # half of the count before the block, not of the half
        with step_threads(True):  # nested: the outer count stays
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 4
    with step_threads(False):
        assert torch.get_num_threads() == 4


@pytest.mark.usefixtures("four_threads")
def test_a_failing_block_restores_the_count() -> None:
    with pytest.raises(RuntimeError, match="boom"), step_threads(True):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 4
    with step_threads(True):  # the block after a failure lowers again
        assert torch.get_num_threads() == 2


class _MyAdamW(torch.optim.AdamW):  # may override step with reductions
    pass


def test_only_torch_optimizers_known_elementwise_count() -> None:
    w = [torch.nn.Parameter(torch.zeros(2))]
    assert elementwise([torch.optim.AdamW(w), torch.optim.SGD(w, lr=0.1)])
    assert not elementwise([torch.optim.AdamW(w), _MyAdamW(w)])
    assert not elementwise([torch.optim.Adafactor(w)])  # row and column means
    assert kernel_threads() >= 1


def _threads_seen_by_inner_steps(
    inner: type[torch.optim.Optimizer],
    tmp_path: Path,
    others: set[int] | None = None,
    **options: Any,
) -> set[int]:
    """The torch thread counts the inner optimizer's steps ran on, over two streamed steps,
    on this thread (``step()``'s caller; a worker's go to ``others`` when given)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    opt = ts.SwapOptimizer(
        model.named_parameters(), inner, lr=1e-3, swap_dir=tmp_path,
        **{"host_budget": "32KiB", **options},  # (32 KiB: every slice streams)
    )  # fmt: skip
    seen: set[int] = set()
    elsewhere = set() if others is None else others
    caller = threading.current_thread()

    def record(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if type(optimizer) is inner:
            on_worker = threading.current_thread() is not caller
            (elsewhere if on_worker else seen).add(torch.get_num_threads())

    hook = register_optimizer_step_pre_hook(record)
    try:
        for _ in range(2):
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()  # (overlap="forward": the last step on the worker)
    finally:
        hook.remove()
        opt.close()
    return seen


@pytest.mark.usefixtures("four_threads")
@pytest.mark.parametrize("overlap", ["auto", None])
def test_a_step_on_the_callers_thread_runs_elementwise_steps_on_half_the_threads(
    tmp_path: Path, overlap: str | None
) -> None:
    seen = _threads_seen_by_inner_steps(torch.optim.AdamW, tmp_path / "a", overlap=overlap)
    assert seen == {2}
    assert torch.get_num_threads() == 4
    # a subclass may reduce: the thread count stays
    assert _threads_seen_by_inner_steps(_MyAdamW, tmp_path / "b", overlap=overlap) == {4}
    # no slice streams: no I/O thread needs a core
    resident = {"overlap": overlap, "host_budget": "16MiB"}
    assert _threads_seen_by_inner_steps(torch.optim.AdamW, tmp_path / "c", **resident) == {4}


@pytest.mark.usefixtures("four_threads")
def test_a_step_on_the_worker_keeps_the_threads(tmp_path: Path) -> None:
    """overlap="forward" steps beside the next forward: its count stays (see the module)."""
    worker: set[int] = set()
    seen = _threads_seen_by_inner_steps(torch.optim.AdamW, tmp_path, worker, overlap="forward")
    assert seen == set()  # none on this thread
    assert worker == {4}
