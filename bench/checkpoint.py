"""Benchmark: saving an optimizer checkpoint as a snapshot vs torch.save vs copying the folder.

    python bench/checkpoint.py --size 1GiB --dir /nvme/bench [--json out.json]
    python bench/checkpoint.py --size 4GiB --dir /nvme/bench     # a few GiB: ~2-3 min on NVMe

One SwapOptimizer (AdamW, fp32 parameters, host budget = state / 8 so the state lives on disk)
takes one step, which commits. Then three ways to checkpoint it, each timed, with the bytes the
process wrote (``/proc/self/io`` write_bytes) and the peak resident memory above the level
before the save (sampled every 5 ms):
  snapshot   : SwapOptimizer.snapshot(dest) - hard links, documents copied
  torch.save : torch.save(optimizer.state_dict(), dest) - the state gathered into RAM
  copytree   : shutil.copytree(swap_dir, dest) - a plain copy of the folder
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _peak import current_rss  # noqa: E402

from tierswap import SwapOptimizer  # noqa: E402
from tierswap.config import format_size, parse_size  # noqa: E402

STATE_BYTES_PER_PARAM = 12  # AdamW on fp32 params: the param copy, exp_avg, exp_avg_sq


def _written() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def _measure(save: Callable[[], object]) -> dict[str, float]:
    """Seconds, bytes written and peak RSS above the start while ``save()`` runs."""
    base, peak, done = current_rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], current_rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    written, start = _written(), time.perf_counter()
    save()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return {
        "seconds": seconds,
        "bytes_written": _written() - written,
        "peak_rss_above_start": max(peak[0], current_rss()) - base,
    }


def run(size: int, folder: Path, tensors: int) -> dict:
    n_params = max(size // STATE_BYTES_PER_PARAM, tensors)
    per = n_params // tensors
    params = [torch.nn.Parameter(torch.randn(per)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(per)
    state_bytes = per * tensors * STATE_BYTES_PER_PARAM
    budget = max(state_bytes // 8, 64 << 20)
    results: dict = {"state_bytes": state_bytes, "host_budget": budget}
    opt = SwapOptimizer(params, torch.optim.AdamW, swap_dir=folder / "swap", host_budget=budget)
    try:
        opt.step()  # creates the state and commits
        for p in params:
            p.grad = None  # the grads are not part of any checkpoint
        results["snapshot"] = _measure(lambda: opt.snapshot(folder / "snap"))
        results["torch_save"] = _measure(
            lambda: torch.save(opt.state_dict(), folder / "optimizer.pt")
        )
        results["copytree"] = _measure(lambda: shutil.copytree(folder / "swap", folder / "copy"))
    finally:
        opt.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="optimizer state size (default 1GiB)")
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the disk to test")
    parser.add_argument("--tensors", type=int, default=32, help="number of parameter tensors")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    size = parse_size(args.size, name="--size")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierswap-ckpt-") as tmp:
        results = run(size, Path(tmp), args.tensors)
    print(f"optimizer state {format_size(results['state_bytes'])}")
    print(f"{'method':<12}{'seconds':>10}{'written':>14}{'peak RSS +':>14}")
    for name in ("snapshot", "torch_save", "copytree"):
        r = results[name]
        print(
            f"{name:<12}{r['seconds']:>10.3f}{format_size(r['bytes_written']):>14}"
            f"{format_size(max(r['peak_rss_above_start'], 0)):>14}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
