from __future__ import annotations

from tests.optim.conftest import swap_backend

__all__ = ["swap_backend"]
