"""Backward hooks: prefetch during backward, and overlap="backward" stepping on the worker."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batches,
    make_models,
    train_step,
)
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import Stepper


def test_backward_starts_reading_the_first_slices() -> None:
    _, model = make_models()
    with SwapOptimizer(model.parameters(), host_budget="64KiB", overlap=None) as swap:
        data = batches(2)
        train_step(model, swap, data[0])  # creates the state
        pipeline = swap._backend.pipeline
        requested: list[object] = []
        original = pipeline.prefetch

        def recording(jobs):
            jobs = list(jobs)
            requested.extend(job.name for job in jobs)
            return original(jobs)

        pipeline.prefetch = recording
        swap.zero_grad()
        model(data[1]).square().mean().backward()  # no step yet: only hooks ran
        assert requested, "no reads started during backward"
        assert requested[0] == swap.slices[0].index
        reads_before = swap.tier_stats()["nvme"]["reads"]
        swap.step()
        assert swap.tier_stats()["nvme"]["reads"] >= reads_before


def test_overlap_backward_equals_the_plain_step() -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    swap = SwapOptimizer(swap_model.parameters(), lr=1e-2, overlap="backward", host_budget="8KiB")
    with swap:
        for x in batches(3):
            train_step(plain_model, plain, x)
            swap.zero_grad()
            swap_model(x).square().mean().backward()
            swap.synchronize()  # the slices stepped on the worker, during backward
            assert all(p.grad is None for p in swap_model.parameters())  # stepped and freed
            swap.step()
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())


def test_overlap_backward_hooks_hand_slices_to_the_worker_and_return(monkeypatch) -> None:
    """Backward never waits for a slice's reads, step or writes: the hooks queue the slices on
    the optimizer's worker, and ``step()`` waits for them."""
    plain_model, swap_model = make_models()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    swap = SwapOptimizer(swap_model.parameters(), lr=1e-2, overlap="backward", host_budget="8KiB")
    gate = threading.Event()
    step_in_backward = Stepper._step_in_backward

    def held(self, layout, ready):
        assert gate.wait(10), "backward did not return while the worker was held"
        step_in_backward(self, layout, ready)

    monkeypatch.setattr(Stepper, "_step_in_backward", held)
    with swap:
        try:
            for x in batches(2):
                train_step(plain_model, plain, x)
                gate.clear()
                swap.zero_grad()
                swap_model(x).square().mean().backward()  # returns, every slice still queued
                used = [p.grad is not None for p in plain_model.parameters()]
                kept = [p.grad is not None for p in swap_model.parameters()]
                assert any(used)
                assert kept == used, "a slice stepped (and freed its gradients) in backward"
                gate.set()
                swap.step()
        finally:
            gate.set()  # a failure above must not leave the worker held
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())


def test_overlap_backward_with_accumulation() -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    swap = SwapOptimizer(
        swap_model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
        overlap="backward", accumulation_steps=2,
    )  # fmt: skip
    with swap:
        data = batches(6)
        for a, b in zip(data[::2], data[1::2], strict=True):
            plain.zero_grad()
            for x in (a, b):
                plain_model(x).square().mean().backward()
                swap_model(x).square().mean().backward()
            plain.step()
            swap.step()
        assert swap.steps == 3
        assert_same_params(plain_model, swap_model)


def test_add_param_group_after_construction() -> None:
    plain_model, swap_model = make_models()
    plain = torch.optim.Adam([plain_model.inp.weight], lr=1e-2)
    swap = SwapOptimizer([swap_model.inp.weight], torch.optim.Adam, lr=1e-2)
    with swap:
        data = batches(4)
        for x in data[:2]:
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        plain.add_param_group({"params": list(plain_model.out.parameters()), "lr": 1e-3})
        swap.add_param_group({"params": list(swap_model.out.parameters()), "lr": 1e-3})
        for x in data[2:]:
            train_step(plain_model, plain, x)
            train_step(swap_model, swap, x)
        assert_same_params(plain_model, swap_model)
        assert_same_state(plain.state_dict(), swap.state_dict())


def test_add_param_group_too_large_for_the_budget_changes_nothing() -> None:
    _, model = make_models()
    with SwapOptimizer([model.inp.bias], host_budget="8KiB") as swap:
        # bf16: 16 bytes per element (state, master, gradient) in a slice of 1024 elements
        big = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        with pytest.raises(ConfigError, match="minimum"):
            swap.add_param_group({"params": [big]})
        assert len(swap.param_groups) == 1
        assert len(swap._layout.slots) == 1
        train_step(model, swap, batches(1)[0])
