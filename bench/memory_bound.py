"""Benchmark: peak RSS of an offloaded step against the stated bound, also on a slow disk.

    PYTHONPATH=. python bench/memory_bound.py [--runs 3] [--steps 4] [--throttle 300MB,150MB]
                                              [--dir D] [--overlap auto,none] [--commit-every N]

The model is 23 fp32 parameters of 4,194,304 elements (96.5M), stepped by ``SwapOptimizer``
over torch's fused AdamW with ``host_budget=128MiB``, ``commit_every=0`` (``--commit-every``).
Each step's gradients come from a backward (``1e-3 * sum(p.sum())``: a constant gradient per
parameter, no activations), so that the gradient hooks run and the default ``overlap="auto"`` steps
slices in backward, as in training (``--overlap`` names the modes to run, each run of each
interleaved: ``auto``, ``none`` for ``overlap=None``, ``forward``, ``backward``; ``stream``
for ``offload_parameters=True``: each parameter in a module of its own, the optimizer given
the model, so that parameters and gradients live in the swap folder too). ``forward`` runs
the parameters in modules of their own too (the optimizer given the parameters): that mode's
step runs on into the next forward, whose modules wait for their own parameters, and it does
not wait for parameters read outside any module.
Each run is its own process: it notes its RSS after the imports and one step of torch's own
AdamW on a one-element tensor (the baseline: torch imports its compiler stack, about 75 MiB,
the first time any optimizer steps; the imports alone are printed too), makes the
parameters and gradients, steps ``--steps`` times and reports its peak RSS (``VmHWM``). The
bound tierswap states: baseline + 1.1 x (parameters + gradients + host budget). With
``--throttle READ,WRITE`` every run goes under a cgroup blkio cap of the folder's disk
(``bench/_throttle.py``, root only), so that the write-behinds wait on the disk.

``stream`` states another bound: baseline + 1.1 x (host budget + the largest module's
parameter and gradient), whatever the model's size. The model is still built in memory
before the optimizer frees it (streaming cannot build one that does not fit yet), so its run
resets the peak (``/proc/self/clear_refs``) once the optimizer holds the parameters and
reports the peak of the training that follows, and the peak of the construction apart.

Each run also reports how much of its resident set at the end is library pages mapped from
files (``RssFile``) beyond the baseline's: the code of torch's kernels and tierswap's C helpers
that the run used first (clean, shared pages, which the kernel may drop and read again). The
verdict is the peak's; the peak less those pages is an estimate of what the allocations took
(the peak held at most those pages: pages first touched after it make the estimate low).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PARAMS, NUMEL, BUDGET = 23, 4_194_304, 128 << 20
MIB = 1 << 20


def _holders(torch, params):
    """The parameters in modules of their own, whose forward uses them (what streaming needs)."""

    class Holder(torch.nn.Module):
        def __init__(self, param) -> None:
            super().__init__()
            self.param = param

        def forward(self):
            return self.param.sum()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleList(Holder(p) for p in params)

        def forward(self):
            return 1e-3 * sum(part() for part in self.parts)

    return Model()


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def child(folder: Path, steps: int, overlap: str | None, commit_every: int) -> dict[str, float]:
    """One run, in this process: baseline, peak and the bound, in bytes."""
    import torch
    from _peak import current_rss, file_rss, peak_rss

    import tierswap as ts

    imported = current_rss()
    # torch imports its compiler stack (torch._dynamo, ~75 MiB here) the first time any
    # optimizer steps; the baseline includes it, as every torch training process pays it
    tiny = torch.zeros(1, requires_grad=True)
    tiny.grad = torch.zeros(1)
    torch.optim.AdamW([tiny], fused=True).step()
    baseline, baseline_files = current_rss(), file_rss()
    torch.manual_seed(0)
    # filled in place: a temporary per tensor (``randn(n) * 1e-3``) would leave up to ~350 MiB
    # of freed 16 MiB blocks in glibc's heap (its mmap threshold rises to the largest block
    # freed), memory of the caller's own making that this bench does not measure
    params = [torch.nn.Parameter(torch.empty(NUMEL).normal_()) for _ in range(PARAMS)]
    streamed = overlap == "stream"
    model = _holders(torch, params) if streamed or overlap == "forward" else None
    opt = ts.SwapOptimizer(
        model if streamed else params, torch.optim.AdamW, lr=1e-4, fused=True,
        swap_dir=folder, host_budget=BUDGET, commit_every=commit_every,
        overlap="auto" if streamed else overlap, offload_parameters=streamed,
    )  # fmt: skip
    built = peak_rss()
    if streamed and not _reset_peak():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
    with opt:
        for _ in range(steps):
            opt.zero_grad()
            (model() if model is not None else 1e-3 * sum(p.sum() for p in params)).backward()
            opt.step()
        opt.synchronize()
        peak = peak_rss()
        files = file_rss() - baseline_files
    # parameters and gradients: all of them, or the largest module's when they stream
    held = 2 * NUMEL * 4 if streamed else 2 * PARAMS * NUMEL * 4
    return {
        "imported": imported, "baseline": baseline, "peak": peak, "built": built,
        "bound": baseline + 1.1 * (held + BUDGET), "files": files,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--throttle", default=None, help="READ,WRITE caps, e.g. 300MB,150MB")
    p.add_argument("--dir", type=Path, default=None, help="folder on the disk to test")
    p.add_argument("--overlap", default="auto", help="modes, comma-separated: auto,none,...")
    p.add_argument(
        "--commit-every", type=int, default=0, help="commit_every (0: no commits; with 1, "
        "overlap='forward' commits on its worker into the next iteration)",
    )  # fmt: skip
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    modes = args.overlap.split(",")
    if args.child is not None:
        overlap = None if modes[0] == "none" else modes[0]  # or "stream"
        print(json.dumps(child(args.child, args.steps, overlap, args.commit_every)))
        return
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for run, mode in ((run, mode) for run in range(args.runs) for mode in modes):
            command = [sys.executable, __file__, "--child", f"{tmp}/run{run}-{mode}",
                       "--steps", str(args.steps), "--overlap", mode,
                       "--commit-every", str(args.commit_every)]  # fmt: skip
            if args.throttle:
                command = [sys.executable, str(ROOT / "bench/_throttle.py"),
                           "--cap", tmp, args.throttle, "--", *command]  # fmt: skip
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[mode].append(result)
            print(
                f"run {run + 1} {mode}: imports {result['imported'] / MIB:.0f} MiB, baseline "
                f"(after a first torch optimizer step) {result['baseline'] / MIB:.0f} MiB, peak "
                f"{result['peak'] / MIB:.0f} MiB, bound {result['bound'] / MIB:.0f} MiB, "
                f"peak/bound {result['peak'] / result['bound']:.3f} (library pages mapped "
                f"since the baseline {result['files'] / MIB:.0f} MiB; without them "
                f"{(result['peak'] - result['files']) / result['bound']:.3f}); built (before "
                f"the optimizer took the model) {result['built'] / MIB:.0f} MiB",
                flush=True,
            )
    for mode, runs in results.items():
        worst = max(r["peak"] / r["bound"] for r in runs)
        anon = max((r["peak"] - r["files"]) / r["bound"] for r in runs)
        print(f"{mode}: worst peak/bound over {len(runs)} runs: {worst:.3f} ({anon:.3f} "
              f"without library pages mapped since the baseline)"
              f"{' (throttled ' + args.throttle + ')' if args.throttle else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
