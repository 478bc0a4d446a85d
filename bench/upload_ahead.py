"""Benchmark: the parameter uploads' schedule on a GPU-like model, with a simulated copy engine.

    PYTHONPATH=. python bench/upload_ahead.py [--layers 24] [--compute-ms 10] [--copy-gbps 0.42]
                                              [--iters 5] [--rounds 2] [--dir D]

On a GPU a streamed module's parameters are copied to the device on an upload stream, and from
the second iteration the copies of the module used next start at the hook of the module before,
so that they run while that module computes (``offload_parameters=True``; docs/optimizer.md).
This machine has no GPU, so the bench models one, to measure that schedule on the CPU:

- the model: ``--layers`` layers of one fp32 weight (1024 x 1024) whose forward and backward wait
  ``--compute-ms`` and twice that (GIL released), as a thread waits for a GPU's kernels;
- the copy engine: a transfer layer whose copies run one at a time on a thread of their own, each
  taking its bytes at ``--copy-gbps`` (a sleep, then the copy), and whose ``ready`` waits for
  the copy, as the compute stream would (here the calling thread waits in its place).

Every slice stays resident in host memory (a host budget that holds the state), so each value is
in host memory when its module is next and the uploads ahead are never held back by the disk.
Two configurations, interleaved over ``--rounds``, each in this process one after the other:
``ahead`` (what ships) and ``at use`` (the uploads ahead turned off: each module's copies start at
its own hook). Reports the median iteration of iterations 2.. (the first records the order of
uses), its forward and backward, the compute alone, and whether both end with the same
parameters. What it does not model: a GPU's kernels queued ahead of the host (here the host waits
for each layer), the step's own copies (the step runs on the CPU, as it does on a GPU with
``offload_parameters``), and the caching allocator. The GPU's own figures come from
``bench/gpu_check.py`` (check 11) where a device is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierswap.engine import ToDevice, ToHost, completed  # noqa: E402
from tierswap.optim import SwapOptimizer  # noqa: E402
from tierswap.optim.stream import _stream, _swap  # noqa: E402

SHAPE = (1024, 1024)


class SimulatedCopies:
    """A transfer layer that copies as a GPU's copy engine would, on host memory: one copy at a
    time on its own thread, each ``nbytes / bandwidth`` seconds long; ``ready`` waits for it."""

    moves = True

    def __init__(self, bandwidth: float) -> None:
        self.device = torch.device("cpu")
        self._bandwidth = bandwidth
        self._queue: queue.SimpleQueue[tuple[Any, Any, Future[None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._engine, daemon=True)
        self._thread.start()

    def _engine(self) -> None:
        while (item := self._queue.get()) is not None:
            source, target, done = item
            time.sleep(source.numel() * source.element_size() / self._bandwidth)
            with torch.no_grad():
                target.copy_(source)
            done.set_result(None)

    def to_device(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None = None,
        *,
        upload_memory: bool = False,
    ) -> ToDevice:
        target = torch.empty_like(host_tensor) if device_tensor is None else device_tensor
        done: Future[None] = Future()
        self._queue.put((host_tensor, target, done))
        return ToDevice(target, None, done)

    def allocating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def ready(self, copy: ToDevice) -> torch.Tensor:
        copy.done.result()
        return copy.device_tensor

    def to_host(
        self, device_tensor: torch.Tensor, host_tensor: torch.Tensor | None = None
    ) -> ToHost:
        out = torch.empty_like(device_tensor) if host_tensor is None else host_tensor
        with torch.no_grad():
            out.copy_(device_tensor.detach().view(out.shape))
        return ToHost(out, completed())

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Waits(torch.autograd.Function):
    """A layer computed elsewhere: forward and backward wait (GIL released)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, seconds: float) -> Any:
        time.sleep(seconds)
        ctx.seconds = seconds
        ctx.save_for_backward(weight)
        return x + weight[0, : x.shape[-1]].sum() * 0  # depends on the weight, changes nothing

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(2 * ctx.seconds)
        (weight,) = ctx.saved_tensors
        return grad, torch.full_like(weight, 1e-3) * grad.sum(), None


class Layer(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(SHAPE) * 0.02)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> Any:
        return _Waits.apply(x, self.weight, self.seconds)


def _model(layers: int, seconds: float) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Layer(seconds) for _ in range(layers)))


def _run(args: argparse.Namespace, folder: Path, ahead: bool | None) -> dict[str, Any]:
    """One configuration: ``ahead`` True or False streams (uploads ahead on or off), ``None``
    is the compute alone (no optimizer step, parameters in memory)."""
    model = _model(args.layers, args.compute_ms / 1000)
    x = torch.ones(4, 16)
    copies = SimulatedCopies(args.copy_gbps * 1e9)
    original = _swap.transfers_for, _stream.ParameterStream._upload_ahead
    _swap.transfers_for = lambda device: copies
    if ahead is False:
        _stream.ParameterStream._upload_ahead = lambda self, position: None  # type: ignore[method-assign]
    opt = None
    if ahead is not None:
        state = sum(p.numel() for p in model.parameters()) * 4 * 4  # master, moments, gradient
        opt = SwapOptimizer(model, torch.optim.AdamW, lr=1e-4, swap_dir=folder,
                            host_budget=2 * state, offload_parameters=True)  # fmt: skip
    times: list[tuple[float, float, float]] = []
    try:
        for _ in range(args.iters):
            start = time.perf_counter()
            loss = model(x).sum()
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                model.zero_grad()
            times.append((forward - start, backward - forward, time.perf_counter() - start))
        uploaded = opt.tier_stats()["parameters"]["uploaded_ahead_bytes"] if opt else 0
    finally:
        if opt is not None:
            opt.close()
        _swap.transfers_for, _stream.ParameterStream._upload_ahead = original  # type: ignore[method-assign]
        copies.close()
    steady = times[1:]
    return {
        "forward_s": statistics.median(t[0] for t in steady),
        "backward_s": statistics.median(t[1] for t in steady),
        "iteration_s": statistics.median(t[2] for t in steady),
        "uploaded_ahead_bytes": uploaded,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--compute-ms", type=float, default=10.0, help="each layer's forward")
    p.add_argument("--copy-gbps", type=float, default=0.42, help="the copy engine's GB/s")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", type=Path, default=None, help="folder for the swap folders")
    args = p.parse_args()
    copy_ms = SHAPE[0] * SHAPE[1] * 4 / (args.copy_gbps * 1e9) * 1000
    print(f"{args.layers} layers of {SHAPE[0]} x {SHAPE[1]} fp32; forward {args.compute_ms:.1f} "
          f"ms a layer, backward twice that; a layer's copy {copy_ms:.1f} ms")  # fmt: skip
    configs = {"compute alone": None, "at use": False, "ahead": True}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for round_ in range(args.rounds):
            for name, ahead in configs.items():
                folder = Path(tmp) / f"{name.replace(' ', '-')}-{round_}"
                results[name].append(_run(args, folder, ahead))
                print(f"round {round_ + 1}/{args.rounds} {name:<14} "
                      f"{results[name][-1]['iteration_s']:.3f} s/iter", flush=True)  # fmt: skip
    print(f"{'config':<14} {'iteration s':>12} {'forward s':>10} {'backward s':>11} "
          f"{'x compute':>10} {'uploaded ahead':>15}")  # fmt: skip
    alone = statistics.median(r["iteration_s"] for r in results["compute alone"])
    for name, runs in results.items():
        it = statistics.median(r["iteration_s"] for r in runs)
        fwd = statistics.median(r["forward_s"] for r in runs)
        bwd = statistics.median(r["backward_s"] for r in runs)
        up = runs[-1]["uploaded_ahead_bytes"] / 2**20
        print(f"{name:<14} {it:12.3f} {fwd:10.3f} {bwd:11.3f} {it / alone:10.2f} {up:12.0f} MiB")
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            results["ahead"][-1]["params"], results["at use"][-1]["params"], strict=True
        )
    )
    print(f"the same parameters with and without uploads ahead: {same}")


if __name__ == "__main__":
    main()
