from __future__ import annotations

import pytest

from tests.optim import fakes
from tierswap.optim import _backend


def _fake_open(path, *, host_budget, device_budget, policy, durable, resume):
    store = fakes.FakeStore(path, mode="a" if resume else "w", durable=durable)
    return store, fakes.FakeCache(store, device_budget=device_budget, host_budget=host_budget)


@pytest.fixture(autouse=True)
def swap_backend(monkeypatch):
    """Until tierswap.cache lands, the optimizer runs over the contract-following fakes."""
    try:
        import tierswap.cache
        import tierswap.store  # noqa: F401
    except ImportError:
        monkeypatch.setattr(_backend, "_open_cache", _fake_open)
