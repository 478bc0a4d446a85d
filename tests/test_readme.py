"""The README's ```python code blocks run, in order, in one namespace.

Blocks fenced as ```py are fragments (the one-line drop-in at the top) and are not run.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp() lands in tmp_path
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README lost its code examples"
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
