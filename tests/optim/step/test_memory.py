"""Peak RSS of a swapped step stays near params + grads + host budget (real-size runs in child
processes, some slow), and the allocator settings a step runs under."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.optim.step import _memory

ROOT = Path(__file__).resolve().parents[3]

#: The start of every child: imports and the resident-set reading (format with ``root``).
PREAMBLE = """
import json, os, sys, threading, time, torch
sys.path.insert(0, {root!r})
import tierswap as ts
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def peak_rss():
    # this process's own high-water mark: ru_maxrss would also hold the RSS of the parent
    # that spawned it (pytest's, over 500 MiB in a full run), which exec carries over
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
"""

CHILD = (
    PREAMBLE
    + """warm = torch.nn.Parameter(torch.zeros(8))
warm.grad = torch.zeros(8)
torch.optim.AdamW([warm]).step()  # torch loads its optimizer machinery (~80 MB) on first use
runtime = rss()
params = [torch.nn.Parameter(torch.randn(1_000_000)) for _ in range(40)]
for p in params:
    p.grad = torch.randn_like(p)
budget = 40_000_000 * 8 // 8
with ts.SwapOptimizer(params, swap_dir={swap!r}, host_budget=budget, durable=False) as opt:
    for _ in range(3):
        opt.step()
peak = peak_rss()
print(json.dumps({{"runtime": runtime, "peak": peak, "budget": budget}}))
"""
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_peak_rss_is_params_grads_budget_and_small_overhead(tmp_path) -> None:
    code = CHILD.format(root=str(ROOT), swap=str(tmp_path / "swap"))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=240
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    params_and_grads = 2 * 40_000_000 * 4
    # the documented bound: 10% over params + grads + host budget, I/O buffers included
    limit = 1.1 * (params_and_grads + figures["budget"])
    assert figures["peak"] - figures["runtime"] <= limit


SLOW_DISK_CHILD = (
    PREAMBLE
    + """warm = torch.nn.Parameter(torch.zeros(8))
warm.grad = torch.zeros(8)
torch.optim.AdamW([warm], fused=True).step()
runtime = rss()
params = [torch.nn.Parameter(torch.randn(2_000_000)) for _ in range(12)]
for p in params:
    p.grad = torch.randn_like(p)
budget = 16 << 20
opt = ts.SwapOptimizer(params, torch.optim.AdamW, fused=True, swap_dir={swap!r},
                       host_budget=budget, commit_every=0, state_precision={precision!r})
store = opt._backend.store  # a disk of 200 MB/s reads and 100 MB/s writes, one request at a time
locks = {{"read_file": threading.Lock(), "write_file": threading.Lock()}}
rates = {{"read_file": 200e6, "write_file": 100e6}}
class Throttled:
    def __init__(self, inner):
        self.inner = inner
    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in rates:
            return attr
        def call(path, buf, *args, **kwargs):
            with locks[name]:
                time.sleep(buf.size / rates[name])
            return attr(path, buf, *args, **kwargs)
        return call
store._engine = store._chunks.engine = Throttled(store._engine)
for _ in range(2):
    opt.step()
    opt.synchronize()
host = opt.tier_stats()["host"]
peak = peak_rss()  # over the steps
opt.close()
print(json.dumps({{"runtime": runtime, "peak": peak, "budget": budget, "host": host}}))
"""
)


def _slow_disk_run(tmp_path, precision: str = "fp32") -> dict:
    code = SLOW_DISK_CHILD.format(root=str(ROOT), swap=str(tmp_path / "swap"), precision=precision)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=240
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_ledger_holds_the_budget_on_a_slow_disk(tmp_path, precision: str) -> None:
    """Every request delayed: reads and writes pile up, yet the host ledger never passes the
    budget (it counts every buffer held while a read or write is pending, the work buffer of
    compact state and the state torch creates on the first step included)."""
    figures = _slow_disk_run(tmp_path, precision)
    host = figures["host"]
    assert 0 < host["peak"] <= host["budget"] == figures["budget"]
    assert host["misses"] > 0  # the state streamed through the throttled disk


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_stays_bounded_on_a_slow_disk(tmp_path, precision: str) -> None:
    """Peak RSS stays within runtime + 1.1 x (params + grads + budget) on a slow disk.

    It used to fail inside full runs (282-311 MiB above the runtime against a limit of
    219-230) and pass alone: the child read its peak from ``ru_maxrss``, which holds the RSS
    of the pytest process that spawned it. It reads its own ``VmHWM`` now. Slow: about 10 s,
    and the run sits at 1.07x of the bound, so a machine with other allocator or huge-page
    habits could cross it; run it where the figures are taken. With bf16 moments the work
    buffer of their decodings is in the budget too (215 MiB against 219 here, fp32 214).
    """
    figures = _slow_disk_run(tmp_path, precision)
    params_and_grads = 2 * 12 * 2_000_000 * 4
    above = figures["peak"] - figures["runtime"]
    limit = 1.1 * (params_and_grads + figures["budget"])
    assert above <= limit, (
        f"peak RSS {above >> 20} MiB above the runtime, limit {limit / 2**20:.0f}"
    )


def test_steps_run_under_the_step_threshold_and_leave_the_idle_one(monkeypatch) -> None:
    """The threshold is the step's from the first step that starts until the last one running
    ends (the forward-overlap worker and step() may overlap), the idle one after; an error
    inside a step restores it too."""
    from tierswap.optim.step import _memory

    calls: list[int] = []
    monkeypatch.setattr(_memory, "_set_mmap_threshold", calls.append)
    with _memory.step_allocations():
        with _memory.step_allocations():  # a part of a step, or a second step at once
            pass
        assert calls == [_memory.STEP_MMAP_THRESHOLD]
    assert calls == [_memory.STEP_MMAP_THRESHOLD, _memory.IDLE_MMAP_THRESHOLD]
    with pytest.raises(RuntimeError), _memory.step_allocations():
        raise RuntimeError("a failed step")
    assert calls[-1] == _memory.IDLE_MMAP_THRESHOLD
    assert len(calls) == 4


def test_an_optimizer_step_runs_under_the_step_threshold(monkeypatch, tmp_path) -> None:
    calls: list[int] = []
    monkeypatch.setattr(_memory, "_set_mmap_threshold", calls.append)
    param = torch.nn.Parameter(torch.randn(64))
    with ts.SwapOptimizer([param], swap_dir=tmp_path / "run") as opt:
        assert calls == []  # construction leaves the allocator alone
        param.grad = torch.randn(64)
        opt.step()
    assert calls == [_memory.STEP_MMAP_THRESHOLD, _memory.IDLE_MMAP_THRESHOLD]


def test_an_optimizer_streaming_parameters_holds_the_step_threshold(monkeypatch, tmp_path) -> None:
    """Streamed parameters and gradients come and go in forward and backward: from the
    optimizer's construction to its close() the streaming threshold holds between steps."""
    calls: list[int] = []
    monkeypatch.setattr(_memory, "_set_mmap_threshold", calls.append)
    model = torch.nn.Linear(8, 8)
    with ts.SwapOptimizer(model, swap_dir=tmp_path / "run", offload_parameters=True) as opt:
        assert calls == [_memory.STREAM_MMAP_THRESHOLD]
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert calls[-2:] == [_memory.STEP_MMAP_THRESHOLD, _memory.STREAM_MMAP_THRESHOLD]
    assert calls[-1] == _memory.IDLE_MMAP_THRESHOLD
