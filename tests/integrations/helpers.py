"""Loading the examples the trainer-integration tests run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(filename: str) -> ModuleType:
    """The module of ``examples/<filename>``, loaded from its file (examples are not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"example_{Path(filename).stem}", EXAMPLES / filename
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
