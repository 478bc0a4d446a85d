"""What ``param.grad`` holds while a streamed parameter's gradient lives in the swap space.

A tensor of the gradient's shape, dtype and device, without memory. ``param.grad is not None``
still says that the parameter has a gradient (what ``step()`` and trainers look at), and
global-norm clipping works on it as it does on a gradient in memory, bitwise:
``torch.nn.utils.clip_grad_norm_`` (which the Hugging Face Trainer, Accelerate and Lightning
call) takes each gradient's norm, which the stand-in answers from the swap space (the 2-norm
noted as backward finalized the gradient, else the gradient read back), and multiplies each
gradient by the clipping factor in place, which the stand-in records for the step to apply
as it reads the gradient. A ``GradScaler``'s unscale works the same way: whether each gradient
is finite is noted in backward (read back the first time a scaler asks), and its factor is
recorded. Clipping by value (``torch.nn.utils.clip_grad_value_``, Lightning's
``gradient_clip_algorithm="value"``) clamps each gradient in place: the clamp is recorded in
turn, and a norm asked after it is computed on the gradient read back. Any other operation
(an edit, a read of the values) raises
:class:`~tierswap.errors.GradientOffloadedError`: it would not see the gradient, and must not
silently do nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar, Protocol

import torch
from torch.utils._foreach_utils import _has_foreach_support

from tierswap.errors import GradientOffloadedError

__all__ = ["GradientKeeper", "OffloadedGradient", "norm_as_torch"]

_aten = torch.ops.aten
#: In-place multiplications by one factor: what clipping does to each gradient.
_SCALES = {_aten.mul_.Tensor, _aten.mul_.Scalar}
_LIST_SCALES = {_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar}
#: A ``GradScaler``'s unscale of a list of gradients, checking them for inf and NaN.
_UNSCALE = _aten._amp_foreach_non_finite_check_and_unscale_.default
#: In-place clamps (``clip_grad_value_``): op -> the names of its bounds, in the order its
#: arguments after the gradient give them.
_CLAMPS = {
    _aten.clamp_.default: ("min", "max"),
    _aten.clamp_.Tensor: ("min", "max"),
    _aten.clamp_min_.default: ("min",),
    _aten.clamp_min_.Tensor: ("min",),
    _aten.clamp_max_.default: ("max",),
    _aten.clamp_max_.Tensor: ("max",),
}
_LIST_CLAMPS = {
    _aten._foreach_clamp_min_.Scalar: ("min",),
    _aten._foreach_clamp_max_.Scalar: ("max",),
}


class GradientKeeper(Protocol):
    """Who keeps the gradients (:class:`~tierswap.optim.stream.ParameterStream`)."""

    def grad_norm(self, index: int, ord: float) -> torch.Tensor:
        """The ``ord``-norm of slot ``index``'s kept gradient, scaled as recorded."""
        ...

    def scale_grad(self, index: int, factor: Any) -> None:
        """Record that slot ``index``'s kept gradient is multiplied by ``factor``."""
        ...

    def grad_finite(self, index: int) -> bool:
        """Whether slot ``index``'s kept gradient, scaled as recorded, is all finite."""
        ...

    def clamp_grad(self, index: int, low: Any, high: Any) -> None:
        """Record that slot ``index``'s kept gradient is clamped into ``[low, high]``."""
        ...


class OffloadedGradient(torch.Tensor):
    """The stand-in gradient of the parameter of slot ``index``, whose gradient ``keeper``
    keeps in the swap space."""

    _MESSAGE: ClassVar[str] = (
        "this gradient lives in the swap space (offload_parameters=True keeps gradients off "
        "the model), so {op} would not see it; clipping (torch.nn.utils.clip_grad_norm_, "
        "opt.clip_grad_norm_, clip_grad_value_) and a GradScaler's unscale work, other uses "
        "of param.grad are not supported with offload_parameters yet"
    )

    _keeper: weakref.ref[GradientKeeper]
    _index: int

    @staticmethod
    def __new__(cls, param: torch.Tensor, keeper: GradientKeeper, index: int) -> OffloadedGradient:
        made: OffloadedGradient = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )
        made._keeper = weakref.ref(keeper)
        made._index = index
        return made

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        kwargs = kwargs or {}
        grad: Any = args[0] if args else None
        if func in _CLAMPS and isinstance(grad, OffloadedGradient):
            low, high = _bounds(_CLAMPS[func], args[1:], kwargs)
            grad._keeper_or_raise(func).clamp_grad(grad._index, low, high)
            return grad
        if func in _LIST_CLAMPS and _all_offloaded(grad) and len(args) == 2 and not kwargs:
            low, high = _bounds(_LIST_CLAMPS[func], args[1:], {})
            for g in grad:
                g._keeper_or_raise(func).clamp_grad(g._index, low, high)
            return None
        if _all_offloaded(grad) and not kwargs:  # foreach=True clipping
            if func is _aten._foreach_norm.Scalar and len(args) <= 2:
                return [g._keeper_or_raise(func).grad_norm(g._index, _ord(args)) for g in grad]
            if func in _LIST_SCALES and len(args) == 2 and _is_factor(args[1]):
                for g in grad:
                    g._keeper_or_raise(func).scale_grad(g._index, args[1])
                return None
            if func is _UNSCALE and len(args) == 3 and _is_factor(args[2]):
                _unscale(grad, found_inf=args[1], inv_scale=args[2])
                return None
        if isinstance(grad, OffloadedGradient) and not kwargs:
            if func is _aten.linalg_vector_norm.default and len(args) <= 2:
                return grad._keeper_or_raise(func).grad_norm(grad._index, _ord(args))
            if func in _SCALES and len(args) == 2 and _is_factor(args[1]):
                grad._keeper_or_raise(func).scale_grad(grad._index, args[1])
                return grad
        raise GradientOffloadedError(cls._MESSAGE.format(op=func))

    def _keeper_or_raise(self, func: Any) -> GradientKeeper:
        keeper = self._keeper()
        if keeper is None:  # the optimizer is gone, and its swap space with it
            raise GradientOffloadedError(self._MESSAGE.format(op=func))
        return keeper

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OffloadedGradient(shape={tuple(self.shape)}, dtype={self.dtype})"


def _unscale(
    grads: list[OffloadedGradient], *, found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """A ``GradScaler``'s unscale (``_amp_foreach_non_finite_check_and_unscale_``) of kept
    gradients: ``found_inf`` becomes 1 if one of them has an inf or NaN, and each is
    multiplied by ``inv_scale`` (recorded, as clipping's factor is), found or not."""
    for g in grads:
        if not g._keeper_or_raise(_UNSCALE).grad_finite(g._index):
            found_inf.fill_(1.0)
    for g in grads:
        g._keeper_or_raise(_UNSCALE).scale_grad(g._index, inv_scale)


def _bounds(
    names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """The (low, high) bounds of a clamp called with ``args`` after the gradient and
    ``kwargs``, for an op whose bound arguments are ``names``; ``GradientOffloadedError``
    for a bound that is not a number or a one-element tensor."""
    given = dict(zip(names, args, strict=False)) | kwargs
    bounds = given.get("min"), given.get("max")
    if any(b is not None and not _is_factor(b) for b in bounds) or bounds == (None, None):
        raise GradientOffloadedError(OffloadedGradient._MESSAGE.format(op="clamp_"))
    return bounds


def _all_offloaded(value: Any) -> bool:
    """A non-empty list of stand-ins (what the foreach operations get)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(g, OffloadedGradient) for g in value)
    )


def _ord(args: tuple[Any, ...]) -> float:
    return float(args[1]) if len(args) > 1 else 2.0


def _is_factor(value: Any) -> bool:
    """A number, or a tensor of one element (clipping's factor, on any device)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not isinstance(value, OffloadedGradient)
    return isinstance(value, (int, float))


def norm_as_torch(grad: torch.Tensor, ord: float) -> torch.Tensor:
    """``grad``'s ``ord``-norm as ``torch.nn.utils.get_total_norm`` takes each gradient's:
    with ``torch._foreach_norm`` where torch would use it, else ``torch.linalg.vector_norm``."""
    norm: torch.Tensor
    if _has_foreach_support([grad], grad.device):
        norm = torch._foreach_norm([grad], ord)[0]
    else:
        norm = torch.linalg.vector_norm(grad, ord)
    return norm
