from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import crc32c
import numpy as np
import pytest

from tierswap.config import IOConfig
from tierswap.errors import ConfigError, CorruptionError
from tierswap.io._engine import IOEngine, gather


@pytest.fixture(params=["auto", "off"])
def engine(request, tmp_path: Path):
    eng = IOEngine(IOConfig(block_bytes=8192, threads=2, direct=request.param), tmp_path)
    yield eng
    eng.close()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 8192, 8193, 30000])
@pytest.mark.parametrize("misalign", [0, 3])
def test_write_read_round_trip(engine: IOEngine, tmp_path: Path, size: int, misalign: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size + misalign, dtype=np.uint8)
    src = data[misalign:]
    file_size = max(-(-size // 4096) * 4096, 4096)
    path = tmp_path / "f"
    crc = engine.write_file(path, src, file_size)
    assert crc == (crc32c.crc32c(src.tobytes()) if size else 0)
    assert path.stat().st_size == file_size
    assert path.read_bytes()[:size] == src.tobytes()
    assert path.read_bytes()[size:] == bytes(file_size - size)  # zero padding
    dst = np.zeros(size + misalign, dtype=np.uint8)[misalign:]
    assert engine.read_file(path, dst) == crc
    assert np.array_equal(dst, src)


def test_read_into_spare_bytes_in_place(engine: IOEngine, tmp_path: Path) -> None:
    src = np.arange(5000, dtype=np.uint8)
    engine.write_file(tmp_path / "f", src, 8192)
    import mmap

    page = np.frombuffer(mmap.mmap(-1, 8192), dtype=np.uint8)
    engine.read_file(tmp_path / "f", page[:5000], spare=8192 - 5000)
    assert np.array_equal(page[:5000], src)


def test_short_file_is_corruption(engine: IOEngine, tmp_path: Path) -> None:
    engine.write_file(tmp_path / "f", np.ones(100, dtype=np.uint8), 4096)
    with pytest.raises(CorruptionError, match="truncated"):
        engine.read_file(tmp_path / "f", np.zeros(9000, dtype=np.uint8))
    with pytest.raises(CorruptionError, match="missing"):
        engine.read_file(tmp_path / "nope", np.zeros(10, dtype=np.uint8))


def test_direct_on_is_refused_where_unsupported(tmp_path: Path, monkeypatch) -> None:
    from tierswap.io import _engine as engine_module

    monkeypatch.setattr(engine_module, "_probe_write", lambda _dir: False)
    with pytest.raises(ConfigError, match="O_DIRECT"):
        IOEngine(IOConfig(direct="on"), tmp_path)
    fallback = IOEngine(IOConfig(direct="auto"), tmp_path)
    assert fallback.direct is False
    fallback.close()


def test_submit_bounds_requests_in_flight(tmp_path: Path) -> None:
    eng = IOEngine(IOConfig(threads=2, inflight=3, direct="off"), tmp_path)
    release = threading.Event()
    outstanding, peak, lock = [0], [0], threading.Lock()

    def job() -> None:
        release.wait(5)
        with lock:
            outstanding[0] -= 1

    def submitter() -> None:
        for _ in range(10):
            with lock:
                outstanding[0] += 1
                peak[0] = max(peak[0], outstanding[0])
            eng.submit(job)

    thread = threading.Thread(target=submitter)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # blocked: 3 requests are outstanding
    release.set()
    thread.join(5)
    eng.close()
    assert peak[0] <= 4  # three held slots plus the one waiting to be admitted


def test_gather_orders_results_and_reports_failure() -> None:
    futures: list[Future[int]] = [Future() for _ in range(3)]
    combined = gather(futures)
    for value, future in reversed(list(enumerate(futures))):
        future.set_result(value)
    assert combined.result() == [0, 1, 2]
    failing: list[Future[int]] = [Future(), Future()]
    combined = gather(failing)
    failing[0].set_exception(ValueError("boom"))
    assert not combined.done()
    failing[1].set_result(1)
    with pytest.raises(ValueError, match="boom"):
        combined.result()
    assert gather([]).result() == []
