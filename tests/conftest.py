from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Builds tierswap's C kernels into this run's temporary folder, not the user's cache
    (child processes inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERSWAP_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
