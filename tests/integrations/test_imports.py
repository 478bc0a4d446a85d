"""Each integration imports with only its own extra installed (the others blocked)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: The third-party packages of each extra's integration modules.
FRAMEWORKS = {
    "hf": ("transformers",),
    "accelerate": ("accelerate",),
    "lightning": ("pytorch_lightning", "lightning"),
}
#: What each integration module may import beyond torch and tierswap's own dependencies.
NEEDS = {"hf": {"hf"}, "accelerate": {"accelerate"}, "lightning": {"lightning"}}


def _import_without(module: str, blocked: list[str]) -> subprocess.CompletedProcess[str]:
    """Import ``module`` in a fresh interpreter where ``blocked`` packages look uninstalled:
    not importable (``sys.modules[name] = None``) and without distribution metadata (which
    libraries such as torchmetrics consult before importing an optional package)."""
    code = textwrap.dedent(
        f"""
        import importlib.metadata as metadata
        import re
        import sys

        def normal(name):
            return re.sub(r"[-_.]+", "_", name).lower()

        hidden = {{normal(name) for name in {blocked!r}}}
        from_name = metadata.Distribution.from_name.__func__

        def without_blocked(cls, name):
            if normal(name) in hidden:
                raise metadata.PackageNotFoundError(name)
            return from_name(cls, name)

        metadata.Distribution.from_name = classmethod(without_blocked)
        for name in {blocked!r}:
            sys.modules[name] = None
        import {module}
        leaked = sorted(n for n in {blocked!r} if sys.modules.get(n) is not None)
        assert not leaked, leaked
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )


@pytest.mark.parametrize("integration", sorted(NEEDS))
def test_an_integration_imports_without_the_other_extras(integration: str) -> None:
    pytest.importorskip(FRAMEWORKS[integration][0])
    blocked = [
        package
        for other, packages in FRAMEWORKS.items()
        if other not in NEEDS[integration]
        for package in packages
    ]
    result = _import_without(f"tierswap.integrations.{integration}", blocked)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_core_imports_without_any_framework() -> None:
    blocked = [package for packages in FRAMEWORKS.values() for package in packages]
    result = _import_without("tierswap, tierswap.optim, tierswap.cli", blocked)
    assert result.returncode == 0, result.stderr[-2000:]
