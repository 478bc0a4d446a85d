"""``tierswap bench --dir A --dir B``: each folder's rate, their weights, and the store striped
over all of them.

After every folder has been measured on its own (the settings grid, per folder), the tierswap
setting with the best balanced (read and write) throughput summed over the folders is taken;
each folder's weight is its balanced rate with that setting. Then, ``--repeat`` times and
interleaved, each folder runs that setting alone and a store striped over all the folders
(``SwapStore([A, B, ...])`` with those weights) runs it too: the striped rate over the sum of
the single-folder rates is how well the drives scale together (1.0: perfectly).
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierswap.cli._measure import GB, DropMethod, Sample, Setting, Stats, drop_page_cache, elapsed
from tierswap.cli._report import TIERSWAP_ENGINES, BenchReport
from tierswap.config import ALIGN, IOConfig
from tierswap.errors import BenchmarkError, ConfigError
from tierswap.store import SwapStore

__all__ = ["Striped", "StripedEngine", "best_common", "io_config", "run_striped_trial"]

_KEY = "bench/tensor"
_CHUNK = 16 << 20


def best_common(reports: list[BenchReport]) -> Setting:
    """The tierswap setting measured in every folder with the best summed balanced rate."""
    rates: dict[Setting, list[float]] = {}
    for report in reports:
        for result in report.results:
            if result.setting.engine in TIERSWAP_ENGINES and result.samples:
                rates.setdefault(result.setting, []).append(result.balanced_bps)
    common = {s: sum(r) for s, r in rates.items() if len(r) == len(reports)}
    if not common:
        raise ConfigError(
            "several --dir need a tierswap engine (direct or buffered) that ran in every folder"
        )
    return max(common, key=lambda s: common[s])


def io_config(setting: Setting, weights: dict[str, float] | None = None) -> IOConfig:
    """The IOConfig of a tierswap ``setting`` (and folder weights)."""
    threads = setting.threads or IOConfig().threads
    return IOConfig(
        block_bytes=setting.block_bytes,
        threads=threads,
        inflight=max(IOConfig().inflight, threads),
        # "auto" re-probes O_DIRECT where the file is used: same choice on this disk, and a
        # buffered fallback instead of an error if the file is reused on another filesystem.
        direct="auto" if setting.engine == "direct" else "off",
        weights=weights or {},
    )


@dataclasses.dataclass
class StripedEngine:
    """tierswap's store over several folders: put + durable commit, then get into ``dst``."""

    src: torch.Tensor
    dst: torch.Tensor
    io: IOConfig

    def chunk_bytes(self, folders: int) -> int:
        """The store's default chunk size, smaller for a small ``--size`` so that every folder
        gets several chunks; never below one block (a request never spans two chunks)."""
        per_folder = self.src.numel() // (4 * folders) // ALIGN * ALIGN
        return max(self.io.block_bytes, min(_CHUNK, per_folder))

    def write(self, folders: list[Path]) -> float:
        stores = [folder / "store" for folder in folders]
        chunk = self.chunk_bytes(len(folders))
        with SwapStore(stores, mode="w", io=self.io, chunk_bytes=chunk) as store:

            def run() -> None:
                store.put(_KEY, self.src)
                store.commit()

            seconds = elapsed(run)
        return self.src.numel() / seconds

    def read(self, folders: list[Path]) -> float:
        with SwapStore([f / "store" for f in folders], mode="r", io=self.io) as store:
            seconds = elapsed(lambda: store.get(_KEY, out=self.dst))
        return self.dst.numel() / seconds


def run_striped_trial(engine: StripedEngine, roots: list[Path], drop: DropMethod) -> Sample:
    """Write through ``engine`` into a fresh folder under each of ``roots``, drop the cache,
    read back, remove the folders."""
    folders = [Path(tempfile.mkdtemp(prefix="trial-", dir=root)) for root in roots]
    try:
        write_bps = engine.write(folders)
        for folder in folders:
            drop_page_cache(folder, drop)
        read_bps = engine.read(folders)
    except ConfigError as exc:  # e.g. O_DIRECT refused where direct="on"
        raise BenchmarkError(str(exc)) from exc
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    return Sample(write_bps, read_bps)


@dataclasses.dataclass
class Striped:
    """The striped measurement: per folder alone, and all folders as one store."""

    setting: Setting
    weights: dict[str, float]  # folder -> balanced GB/s with the setting (the grid's median)
    alone: dict[str, list[Sample]] = dataclasses.field(default_factory=dict)
    together: list[Sample] = dataclasses.field(default_factory=list)

    def _stats(self, samples: list[Sample], direction: str) -> Stats:
        return Stats.of([getattr(s, f"{direction}_bps") for s in samples])

    def summed(self, direction: str) -> float:
        """The sum over the folders of their median rate alone."""
        return sum(self._stats(s, direction).median for s in self.alone.values())

    def scaling(self, direction: str) -> float:
        """Striped median over the summed single-folder medians (1.0: perfect scaling)."""
        return self._stats(self.together, direction).median / self.summed(direction)

    def rows(self) -> list[list[str]]:
        rows = [["folder", "weight", "write GB/s", "read GB/s"]]
        for folder, samples in self.alone.items():
            rates = [f"{self._stats(samples, d).median / GB:.2f}" for d in ("write", "read")]
            rows.append([folder, f"{self.weights[folder]:.3f}", *rates])
        rows.append(["sum", "", *(f"{self.summed(d) / GB:.2f}" for d in ("write", "read"))])
        together = [f"{self._stats(self.together, d).median / GB:.2f}" for d in ("write", "read")]
        rows.append(["striped (one store)", "", *together])
        rows.append(["striped / sum", "", *(f"{self.scaling(d):.2f}x" for d in ("write", "read"))])
        return rows

    def to_json(self) -> dict[str, Any]:
        def rates(samples: list[Sample]) -> dict[str, Any]:
            return {
                f"{d}_gbps": round(self._stats(samples, d).median / GB, 4)
                for d in ("write", "read")
            }

        return {
            "engine": self.setting.engine,
            "block_bytes": self.setting.block_bytes,
            "threads": self.setting.threads,
            "folders": [
                {"dir": folder, "weight": self.weights[folder], **rates(samples)}
                for folder, samples in self.alone.items()
            ],
            "striped": rates(self.together),
            "scaling": {d: round(self.scaling(d), 4) for d in ("write", "read")},
        }


def weights_of(reports: list[BenchReport], setting: Setting) -> dict[str, float]:
    """Each folder's balanced rate (GB/s) with ``setting``: the weights of the striped store."""
    weights = {}
    for report in reports:
        result = next(r for r in report.results if r.setting == setting)
        weights[report.directory] = round(result.balanced_bps / GB, 4)
    return weights


def measure(
    reports: list[BenchReport],
    src: torch.Tensor,
    dst: torch.Tensor,
    roots: list[Path],
    *,
    repeat: int,
    drop: DropMethod,
    single: Callable[[Setting, Path], Sample],
) -> Striped:
    """Run the best common setting alone in each of ``roots`` (bench folders, one per report)
    and striped over all of them, ``repeat`` times interleaved."""
    setting = best_common(reports)
    striped = Striped(setting, weights_of(reports, setting))
    engine = StripedEngine(src, dst, io_config(setting, striped.weights))
    for _ in range(repeat):
        for report, root in zip(reports, roots, strict=True):
            striped.alone.setdefault(report.directory, []).append(single(setting, root))
        striped.together.append(run_striped_trial(engine, roots, drop))
    return striped


def write_tune_file(striped: Striped, path: str | Path) -> IOConfig:
    """Write the common setting with the folders' weights (``IOConfig.from_file`` reads it)."""
    config = io_config(striped.setting, striped.weights)
    measured = {
        **striped.to_json(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    config.to_file(path, measured=measured)
    return config
