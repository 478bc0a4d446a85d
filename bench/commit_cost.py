"""Benchmark: what one durable commit costs at the e2e models' size, against a step.

    python bench/commit_cost.py --dir /nvme/bench [--model mlp|gpt2] [--rounds 4] [--json F]

One SwapOptimizer (AdamW, ``commit_every=0``) on the model of ``bench/e2e.py``; after a
warm-up step and commit, each round times one iteration (forward, backward, ``opt.step()``)
and then one ``opt.commit()``, so step and commit alternate under the same disk conditions.
Two host budgets: ``resident`` (the whole state fits: the commit writes every dirty slice)
and ``streamed`` (128 MiB: the step already wrote the state, the commit makes it durable).
For each commit: its wall time and the bytes the process wrote to the block layer during it
(``/proc/self/io``). The sync barriers a commit makes are listed in docs/format.md; to see
their latency, run this under ``strace -f --seccomp-bpf -w -c -e trace=syncfs,fsync,fdatasync``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _e2e_child import LR, Workload, _disk_bytes

import tierswap

BUDGETS = {"resident": None, "streamed": 128 << 20}


def _one(args: argparse.Namespace, name: str, folder: Path) -> dict:
    work = Workload(args)
    params = sum(p.numel() for p in work.model.parameters())
    budget = BUDGETS[name] if BUDGETS[name] is not None else params * 12 + (256 << 20)
    opt = tierswap.SwapOptimizer(
        work.model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0,
        swap_dir=folder, host_budget=budget, commit_every=0,
    )  # fmt: skip
    steps, commits, written = [], [], []
    try:
        for round_ in range(args.rounds + 1):
            start = time.perf_counter()
            work.loss(work.model).backward()
            opt.step()
            opt.zero_grad()
            step = time.perf_counter() - start
            before = _disk_bytes().get("written", 0)
            start = time.perf_counter()
            opt.commit()
            commit = time.perf_counter() - start
            if round_:  # round 0 warms up (first allocation of every file)
                steps.append(step)
                commits.append(commit)
                written.append(_disk_bytes().get("written", 0) - before)
    finally:
        opt.close()
    return {
        "params": params,
        "state_bytes": params * 12,
        "host_budget": budget,
        "iteration_s": steps,
        "commit_s": commits,
        "commit_written": written,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="folder for the swap folders (removed after)")
    p.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    results = {}
    print("| budget | iteration s (median) | commit s (median, min-max) | MB written per commit |")
    print("|---|---|---|---|")
    for name in BUDGETS:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            r = results[name] = _one(args, name, Path(tmp) / "swap")
        c, iteration = r["commit_s"], statistics.median(r["iteration_s"])
        print(
            f"| {name} ({r['host_budget'] >> 20} MiB) | {iteration:.3f} | "
            f"{statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f}) | "
            f"{statistics.median(r['commit_written']) / 1e6:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, **results}, indent=1))


if __name__ == "__main__":
    main()
