"""``tierswap bench --plot``: GB/s against block size, one line per thread count.

One column per engine, write on top and read below; error bars span min-max of the repeats and a
dashed line marks fio's median when fio ran.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from tierswap.cli._measure import GB, short_size
from tierswap.cli._report import BenchReport, Result
from tierswap.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_report"]


def _series(results: list[Result]) -> dict[int | None, list[Result]]:
    by_threads: dict[int | None, list[Result]] = defaultdict(list)
    for result in sorted(results, key=lambda r: r.setting.block_bytes):
        by_threads[result.setting.threads].append(result)
    return dict(sorted(by_threads.items(), key=lambda kv: kv[0] or 0))


def _draw(axes: Axes, report: BenchReport, results: list[Result], direction: str) -> None:
    for threads, series in _series(results).items():
        xs = [r.setting.block_bytes / (1 << 20) for r in series]
        stats = [getattr(r, direction) for r in series]
        ys = [s.median / GB for s in stats]
        err = [[(s.median - s.low) / GB for s in stats], [(s.high - s.median) / GB for s in stats]]
        label = f"{threads} thread{'s' if threads != 1 else ''}"
        axes.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    if report.fio is not None and report.fio.samples:
        fio = getattr(report.fio, direction).median / GB
        axes.axhline(fio, color="black", linestyle="--", linewidth=1, label="fio")
    blocks = sorted({r.setting.block_bytes for r in results})
    axes.set_xscale("log", base=2)
    axes.set_xticks([b / (1 << 20) for b in blocks], [short_size(b) for b in blocks])
    axes.minorticks_off()
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)


def plot_report(report: BenchReport, path: str | Path) -> None:
    """Draw the report into a PNG at ``path`` (needs matplotlib, from the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib; install it with `pip install tierswap[bench]`"
        ) from exc
    engines: dict[str, list[Result]] = defaultdict(list)
    for result in report.results:
        if result.samples:
            engines[result.setting.engine].append(result)
    if not engines:
        raise ConfigError("--plot has nothing to draw: no engine produced a sample")
    ncols = len(engines)
    fig, axes = plt.subplots(2, ncols, figsize=(3.6 * ncols, 6), squeeze=False, sharey="row")
    for col, (engine, results) in enumerate(engines.items()):
        for row, direction in enumerate(("write", "read")):
            ax = axes[row][col]
            _draw(ax, report, results, direction)
            ax.set_title(f"{engine}: {direction}", fontsize=10)
            ax.set_xlabel("block size (MiB)" if row == 1 else "")
        axes[0][col].legend(fontsize=7)
    axes[0][0].set_ylabel("write GB/s")
    axes[1][0].set_ylabel("read GB/s")
    fig.suptitle(report.caption(), fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
