from __future__ import annotations

import pytest
import torch

from tierswap.io._buffers import aligned_empty, is_aligned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex128])
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (1 << 20,)])
def test_aligned_empty(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = aligned_empty(shape, dtype, pin=False)
    assert t.shape == shape
    assert t.dtype == dtype
    assert t.is_contiguous()
    if t.numel():
        assert is_aligned(t.data_ptr())
        assert t.untyped_storage().nbytes() % 4096 == 0
        t.fill_(1)  # writable


def test_is_aligned() -> None:
    assert is_aligned(8192, 4096)
    assert not is_aligned(8193)
    assert not is_aligned(4096, 10)
