from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
