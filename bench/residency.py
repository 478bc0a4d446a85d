"""Benchmark: what memory buys. Disk bytes per step and iteration time against the tiers' budgets.

    python bench/residency.py [--commit-every 10|auto] [--overlap forward] [--fractions 0,0.5,1]
                              [--width 4096 --depth 6] [--png F] [--json F]

The e2e model of ``bench/e2e.py`` (100.7M fp32 parameters, AdamW state 806 MB) trains with its
state swapped, at host budgets from 0 to 100% of the state, and at a device + host split (25%
each; without a GPU the device tier is a CPU-memory tier of its own). Each configuration runs in
its own process (``bench/_e2e_child.py``), the in-RAM baseline before and after them. For each:
disk bytes read and written per steady step (from ``tier_stats()``), the bound the design sets,
``state - 0.9 x (device + host budgets)``, and the median iteration against the in-RAM one.
A PNG draws the curve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import e2e  # noqa: E402

FRACTIONS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)


def _steady(result: dict[str, Any]) -> dict[str, float]:
    """Median iteration and disk bytes per step over the iterations after the first."""
    moved = result.get("swap_bytes", [])[1:]
    return {
        "iteration_s": statistics.median(result["times"][1:]),
        "read": statistics.median(m["read"] for m in moved) if moved else 0.0,
        "written": statistics.mean(m["written"] for m in moved) if moved else 0.0,
    }


def _run(args: argparse.Namespace, folder: Path, host: int, device: int) -> dict[str, Any]:
    """One tierswap configuration, as a mode of the e2e bench, in its own process."""
    name = f"residency-{host}-{device}"
    e2e.MODES[name] = {"commit_every": args.commit_every, "device_budget": device}
    if args.overlap:
        e2e.MODES[name]["overlap"] = args.overlap
    run = argparse.Namespace(**{**vars(args), "host_budget": max(host, 1 << 20)})
    result = e2e._spawn(run, name, folder / name)
    if "error" in result:
        return {"host": host, "device": device, "error": result["error"]}
    return {"host": host, "device": device, **_steady(result), "tier_stats": result["tier_stats"]}


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    state = e2e._state_bytes(args.width, args.depth)
    ram = [e2e._spawn(args, "ram", folder / "ram-0")]
    points = [_run(args, folder, int(f * state), 0) for f in args.fractions]
    split = _run(args, folder, state // 4, state // 4)
    ram.append(e2e._spawn(args, "ram", folder / "ram-1"))
    ram_s = statistics.median(t for r in ram for t in r["times"][1:])
    for point in [*points, split]:
        budgets = point["host"] + point["device"]
        point["bound"] = max(state - 0.9 * budgets, 0.0)
        if "iteration_s" in point:
            point["ram_over_swap"] = ram_s / point["iteration_s"]
    return {"state": state, "ram_iteration_s": ram_s, "points": points, "split": split}


def print_table(report: dict[str, Any]) -> None:
    state = report["state"]
    print(f"state {state / 1e6:.0f} MB; in-RAM iteration {report['ram_iteration_s']:.3f} s")
    print("host   device  read MB  written MB  bound MB  iteration s  in-RAM/offloaded")
    for p in [*report["points"], report["split"]]:
        if "error" in p:
            print(f"{p['host'] / state:5.0%}  {p['device'] / state:5.0%}  error: {p['error']}")
            continue
        print(
            f"{p['host'] / state:5.0%}  {p['device'] / state:5.0%}  {p['read'] / 1e6:7.0f}  "
            f"{p['written'] / 1e6:10.0f}  {p['bound'] / 1e6:8.0f}  {p['iteration_s']:11.3f}  "
            f"{p['ram_over_swap']:16.2f}"
        )


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = report["state"]
    points = [p for p in report["points"] if "error" not in p]
    x = [100 * p["host"] / state for p in points]
    fig, (disk, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    disk.plot(x, [p["read"] / 1e6 for p in points], "o-", label="read per step")
    disk.plot(x, [p["written"] / 1e6 for p in points], "s-", label="written per step")
    disk.plot(x, [p["bound"] / 1e6 for p in points], "k--", label="state - 0.9 x budget")
    disk.set_xlabel("host budget, % of the state")
    disk.set_ylabel("MB")
    disk.legend()
    time_ax.plot(x, [p["ram_over_swap"] for p in points], "o-", label="in-RAM / offloaded")
    time_ax.axhline(0.7, color="k", linestyle="--", label="target at 50%: 0.7")
    time_ax.set_xlabel("host budget, % of the state")
    time_ax.set_ylabel("iteration speed vs in-RAM")
    time_ax.legend()
    overlap = f", overlap={report['overlap']}" if report.get("overlap") else ""
    fig.suptitle(f"tierswap residency, commit_every={report['commit_every']}{overlap}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--commit-every", type=lambda v: v if v == "auto" else int(v), default=10,
        help="an int, or auto (the default of SwapOptimizer)",
    )  # fmt: skip
    p.add_argument("--overlap", choices=["backward", "forward"], default=None)
    p.add_argument(
        "--fractions", type=lambda v: [float(f) for f in v.split(",")], default=list(FRACTIONS),
        help="host budgets, as fractions of the state (comma-separated)",
    )  # fmt: skip
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--dir", type=Path, default=None, help="folder on the disk to test")
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    # the e2e bench's settings this one does not choose keep their defaults (its --model mlp)
    args = argparse.Namespace(**{**vars(e2e.parse_args([])), **vars(p.parse_args())})
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        report = {
            **measure(args, Path(tmp)), "commit_every": args.commit_every, "overlap": args.overlap,
        }  # fmt: skip
    print_table(report)
    if args.png:
        plot(report, args.png)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
