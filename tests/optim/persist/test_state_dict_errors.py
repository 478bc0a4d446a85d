"""A load_state_dict whose writes fail changes nothing; offload() checks the class."""

from __future__ import annotations

import copy
import errno

import pytest
import torch

import tierswap as ts
from tests.optim.models import assert_same_state, batches, make_models, train_step
from tests.store.faults import inject
from tierswap.errors import ConfigError, OutOfSpaceError
from tierswap.optim import SwapOptimizer


@pytest.mark.parametrize("failing_write", [1, 3, 6])
def test_a_failed_put_leaves_the_optimizer_as_it_was(failing_write: int) -> None:
    _, model = make_models()
    opt = SwapOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    data = batches(4)
    with opt:
        for x in data[:2]:
            train_step(model, opt, x)
        saved = copy.deepcopy(opt.state_dict())
        saved["param_groups"][0]["lr"] = 5.0
        train_step(model, opt, data[2])
        before = copy.deepcopy(opt.state_dict())
        opt._backend.pipeline.evict()  # so that the failing write is one of the load's puts
        store = opt._backend.store
        inject(
            store,
            fail={"write_file": {failing_write}},
            error=lambda: OSError(errno.ENOSPC, "No space left on device"),
        )
        with pytest.raises(OutOfSpaceError):
            opt.load_state_dict(saved)
        store._engine = store._engine.inner
        assert_same_state(before, opt.state_dict())
        assert opt.param_groups[0]["lr"] == 1e-2
        opt.load_state_dict(saved)  # and it loads once the disk has room again
        assert_same_state(saved, opt.state_dict())
        train_step(model, opt, data[3])


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_offload_rejects_what_swap_optimizer_rejects(cls: type) -> None:
    _, model = make_models()
    with pytest.raises(ConfigError, match=f"{cls.__name__} mixes parameters"):
        ts.offload(cls([model.inp.weight], lr=1e-2))
