"""What ``param.grad`` holds while a streamed parameter's gradient lives in the swap space.

A tensor of the gradient's shape, dtype and device, without memory, which refuses every
operation with :class:`~tierswap.errors.GradientOffloadedError`. ``param.grad is not None``
still says that the parameter has a gradient (what ``step()`` and trainers look at), while
code that would read or change the gradient in memory (``torch.nn.utils.clip_grad_norm_``,
``GradScaler.unscale_``, an in-place edit) stops with a message that says what to write
instead, rather than silently clipping nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tierswap.errors import GradientOffloadedError

__all__ = ["OffloadedGradient"]


class OffloadedGradient(torch.Tensor):
    """The stand-in gradient of a parameter whose gradient the swap space keeps."""

    _MESSAGE: ClassVar[str] = (
        "this gradient lives in the swap space (offload_parameters=True keeps gradients off "
        "the model), so {op} would not see it: clip with opt.clip_grad_norm_(max_norm) instead "
        "of torch.nn.utils.clip_grad_norm_; GradScaler and in-place edits of gradients are not "
        "supported with offload_parameters yet"
    )

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> OffloadedGradient:
        made: OffloadedGradient = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )
        return made

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        raise GradientOffloadedError(cls._MESSAGE.format(op=func))

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OffloadedGradient(shape={tuple(self.shape)}, dtype={self.dtype})"
