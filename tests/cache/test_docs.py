"""The runnable code blocks of docs/cache.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "import" in b]


def test_doc_has_runnable_blocks() -> None:
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_block_runs(index: int) -> None:
    exec(compile(BLOCKS[index], f"{DOC.name}[{index}]", "exec"), {"__name__": "__doc__"})
