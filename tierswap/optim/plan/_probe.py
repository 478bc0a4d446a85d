"""What an optimizer class lets tierswap do, found by stepping tiny throw-away parameters.

Two questions decide how a parameter may be streamed:

- **May it be cut?** When flat pieces of a parameter step bitwise like the whole parameter (every
  optimizer whose math is per element: AdamW, SGD, Adagrad, ...), slices may split it anywhere
  on a chunk boundary (:func:`check_elementwise`).
- **Else, may it step alone?** When the math spans one parameter but never several (Muon's
  Newton-Schulz over a matrix, Adafactor's row and column statistics), a slice holds whole
  parameters and steps them together in one call, which is bitwise what the optimizer does
  in memory (:func:`check_per_parameter`). An optimizer that mixes parameters (a norm over the
  whole group, LBFGS) cannot be swapped at all.

The probes also size the state: per-element state for sliced parameters
(:func:`probe_state`), and the state's shapes for whole ones
(:func:`probe_whole_state`), so budgets are checked before anything is written. The
optimizer's construction calls them per param group through :func:`check_class`,
:func:`own_defaults` (a group that names its own ``optimizer_class``), :func:`probe_group` and
:func:`whole_state`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tierswap.errors import ConfigError
from tierswap.optim.plan._partition import StateShapes, local_tensor, master_dtype

__all__ = [
    "check_class",
    "check_elementwise",
    "check_per_parameter",
    "may_slice",
    "own_defaults",
    "probe_group",
    "probe_state",
    "probe_whole_state",
    "whole_state",
]


#: Probe sizes per dimension: distinct primes, so each state dimension can be traced back to
#: the parameter dimension it follows.
_PROBE_DIMS = (3, 5, 7, 11, 13, 17)


def may_slice(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> bool:
    """``True`` when slices may cut parameters of this group; ``False`` when they must hold
    whole parameters; :class:`ConfigError` when the optimizer mixes parameters."""
    try:
        check_elementwise(optimizer_class, group, dtype)
    except ConfigError:
        check_per_parameter(optimizer_class, group, dtype)
        return False
    return True


def check_elementwise(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> None:
    """Raise :class:`ConfigError` unless stepping flat pieces of a parameter is bitwise equal to
    stepping it whole with ``optimizer_class`` (true of every optimizer whose math is per
    element; not of factored or matrix ones such as Adafactor or Muon)."""
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(8, 16, generator=gen).to(dtype)
    grads = [torch.randn(8, 16, generator=gen).to(dtype) for _ in range(2)]
    pieces = whole.clone()
    flat = pieces.view(-1)
    try:
        same = _same_steps(optimizer_class, group, whole, [flat[:64], flat[64:]], grads)
    except Exception as exc:  # e.g. an optimizer that needs 2-D parameters
        raise ConfigError(
            f"{optimizer_class.__name__} cannot step slices of a parameter ({exc}); its math "
            "is not per element"
        ) from exc
    if not same:
        raise ConfigError(
            f"{optimizer_class.__name__} does not give the same result on slices of a parameter "
            "as on the whole parameter (its math is not per element, e.g. factored statistics)"
        )


def check_per_parameter(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> None:
    """Raise :class:`ConfigError` unless stepping two parameters in one call is bitwise equal to
    stepping each in a call of its own: tierswap steps a slice's parameters together, and the
    slices of one step in separate calls."""
    gen = torch.Generator().manual_seed(1)
    shapes = ((8, 16), (16, 8))
    together = [torch.randn(*s, generator=gen).to(dtype) for s in shapes]
    alone = [t.clone() for t in together]
    grads = [[torch.randn(*s, generator=gen).to(dtype) for s in shapes] for _ in range(2)]
    name = optimizer_class.__name__
    try:
        ref = _make(optimizer_class, [{"params": together, **_probe_hyper(group)}])
        each = [_make(optimizer_class, [{"params": [p], **_probe_hyper(group)}]) for p in alone]
        for step_grads in grads:
            for a, b, grad in zip(together, alone, step_grads, strict=True):
                a.grad, b.grad = grad.clone(), grad.clone()
            ref.step()
            for opt in each:
                opt.step()
        same = all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    except Exception as exc:
        raise ConfigError(
            f"{name} cannot step the parameters of a slice on their own ({exc}); tierswap swaps "
            "optimizers whose math stays within each parameter (AdamW, SGD, Muon, Adafactor, ...)"
        ) from exc
    if not same:
        raise ConfigError(
            f"{name} mixes parameters in one step (stepping two parameters together differs "
            "from stepping each alone, e.g. a norm over the whole group); tierswap swaps "
            "optimizers whose math stays within each parameter (AdamW, SGD, Muon, Adafactor, ...)"
        )


def probe_state(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> dict[str, int]:
    """The per-element state tensors this group keeps for a ``dtype`` param: name -> size.

    Steps a throw-away two-element parameter once with the group's hyper-parameters and lists
    the item sizes of the state tensors shaped like it (``exp_avg``, ``momentum_buffer``, ...).
    Scalars such as ``step`` are ignored: they stay in RAM.
    """
    probe = torch.zeros(2, dtype=dtype, requires_grad=True)
    state = _step_once(optimizer_class, group, probe)
    return {
        name: v.element_size()
        for name, v in state.items()
        if torch.is_tensor(v) and v.shape == probe.shape
    }


def probe_whole_state(
    optimizer_class: type[torch.optim.Optimizer],
    group: dict[str, Any],
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> StateShapes:
    """The state tensors (name -> shape, element size) the optimizer keeps for one parameter of
    ``shape`` stepped whole, found on a small parameter with the same number of dimensions.

    Each dimension of a state tensor must follow the parameter's dimension at the same place or
    be 1 (Adafactor's ``row_var`` of shape ``(rows, 1)``, Muon's ``momentum_buffer``); other
    state cannot be sized ahead and raises :class:`ConfigError`. Scalars stay in RAM.
    """
    ndim = len(shape)
    if ndim > len(_PROBE_DIMS):
        raise ConfigError(f"parameters of {ndim} dimensions are not supported here; at most 6")
    probe_dims = _PROBE_DIMS[:ndim]
    probe = torch.zeros(probe_dims, dtype=dtype, requires_grad=True)
    state = _step_once(optimizer_class, group, probe)
    shapes: StateShapes = {}
    for name, value in state.items():
        if not (torch.is_tensor(value) and value.dim() > 0):
            continue
        if value.dim() != ndim or any(
            d not in (1, p) for d, p in zip(value.shape, probe_dims, strict=True)
        ):
            raise ConfigError(
                f"{optimizer_class.__name__}'s state {name!r} has shape {tuple(value.shape)} for "
                f"a parameter of shape {probe_dims}; tierswap sizes state that follows the "
                "parameter's dimensions (or is 1 along some)"
            )
        follows = [d == p for d, p in zip(value.shape, probe_dims, strict=True)]
        real = tuple(s if f else 1 for s, f in zip(shape, follows, strict=True))
        shapes[name] = (real, value.element_size())
    return shapes


def state_numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a state tensor of ``shape``."""
    return math.prod(shape)


def _step_once(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], probe: torch.Tensor
) -> dict[str, Any]:
    probe.grad = torch.ones_like(probe)
    inner = _make(optimizer_class, [{"params": [probe], **_probe_hyper(group)}])
    inner.step()
    return dict(inner.state.get(probe, {}))


def _same_steps(
    optimizer_class: type[torch.optim.Optimizer],
    group: dict[str, Any],
    whole: torch.Tensor,
    pieces: list[torch.Tensor],
    grads: list[torch.Tensor],
) -> bool:
    """Step ``whole`` and, each in a call of its own (as slices step), its flat ``pieces``
    (consecutive, of a copy) with the same gradients; are the results bitwise equal?"""
    hyper = _probe_hyper(group)
    ref = _make(optimizer_class, [{"params": [whole], **hyper}])
    cuts = [_make(optimizer_class, [{"params": [piece], **hyper}]) for piece in pieces]
    for grad in grads:
        whole.grad = grad.clone()
        flat_grad, start = grad.reshape(-1), 0
        for piece in pieces:
            piece.grad = flat_grad[start : start + piece.numel()].clone()
            start += piece.numel()
        ref.step()
        for cut in cuts:
            cut.step()
    return torch.equal(whole.reshape(-1), torch.cat([p.reshape(-1) for p in pieces]))


def _probe_hyper(group: dict[str, Any]) -> dict[str, Any]:
    hyper = {
        k: v for k, v in group.items() if k not in ("params", "param_names", "optimizer_class")
    }
    for key in ("foreach", "fused", "capturable"):  # the probes run on the CPU, plainly
        hyper.pop(key, None)
    if isinstance(hyper.get("lr"), torch.Tensor):
        hyper["lr"] = float(hyper["lr"])
    return hyper


def _make(
    optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """``optimizer_class(groups)``: subclasses give every hyper-parameter a default, which the
    base class's ``(params, defaults)`` signature does not say."""
    factory: Callable[..., torch.optim.Optimizer] = optimizer_class
    return factory(groups)


def check_class(optimizer_class: Any) -> None:
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise ConfigError(
            f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer subclass; "
            "pass e.g. torch.optim.AdamW"
        )
    if issubclass(optimizer_class, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        raise ConfigError(
            f"optimizer_class={optimizer_class.__name__} mixes parameters in one step or needs "
            "sparse gradients; tierswap swaps optimizers with per-parameter state (AdamW, SGD, ...)"
        )


def own_defaults(params: Iterable[Any]) -> list[Any]:
    """``params`` with each param group that names its ``optimizer_class`` completed by that
    class's own defaults (Muon's ``lr``, ``momentum``, ...), before the main class fills in what
    is still missing: a group takes its hyper-parameters from itself, then from its class."""
    items = list(params)
    for position, item in enumerate(items):
        if isinstance(item, dict) and "optimizer_class" in item:
            group_class = item["optimizer_class"]
            check_class(group_class)
            own = {k: v for k, v in item.items() if k != "optimizer_class"}
            filled = group_class([own]).param_groups[0]
            items[position] = {**filled, "optimizer_class": group_class}
    return items


def probe_group(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> tuple[bool, dict[str, int]]:
    """Whether slices may cut this group's ``dtype`` parameters, and their per-element state
    (name -> element size; none for parameters stepped whole: :func:`whole_state` sizes
    those)."""
    if not may_slice(optimizer_class, group, dtype):
        return False, {}
    try:
        return True, probe_state(optimizer_class, group, dtype)
    except Exception as exc:
        raise ConfigError(
            f"cannot size the state of {optimizer_class.__name__} for {dtype} parameters: {exc}"
        ) from exc


def whole_state(
    optimizer_class: type[torch.optim.Optimizer],
    group: dict[str, Any],
    param: torch.Tensor,
    name: str | None,
) -> StateShapes:
    """The state of ``param``, which ``optimizer_class`` steps whole (Muon, Adafactor)."""
    label = name or f"of shape {tuple(param.shape)}"
    if local_tensor(param) is not param:
        raise ConfigError(
            f"parameter {label} is a sharded DTensor, but {optimizer_class.__name__} steps each "
            "parameter whole (its math spans the matrix) and a rank holds only its shard; use "
            "it with DDP / ZeroRedundancyOptimizer (whole parameters per rank), or give sharded "
            "parameters a per-element optimizer such as AdamW"
        )
    try:
        return probe_whole_state(optimizer_class, group, master_dtype(param), tuple(param.shape))
    except ConfigError:
        raise
    except Exception as exc:  # e.g. Muon given a 1-D parameter
        raise ConfigError(
            f"{optimizer_class.__name__} cannot step parameter {label}: {exc}"
        ) from exc
