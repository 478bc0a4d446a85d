"""The slots of a param group: one per parameter, with what the optimizer keeps for it.

A slot records the names and sizes of the parameter's state (probed once per dtype with the
group's torch optimizer), whether it is stepped whole (an optimizer whose math spans the
parameter, such as Muon or Adafactor), whether it needs an fp32 master (a low-precision
parameter, or one on another device than the step), the compact formats the config asks for,
and its keys in the swap store. Private to :mod:`tierswap.optim`.
"""

from __future__ import annotations

from typing import Any

import torch

from tierswap.errors import ConfigError
from tierswap.optim._config import SwapConfig
from tierswap.optim.plan._names import key_prefix
from tierswap.optim.plan._partition import Slot, local_tensor, master_dtype
from tierswap.optim.plan._probe import probe_group, whole_state

__all__ = ["check_streamable", "group_slots", "inner_for"]


def group_slots(
    group: dict[str, Any],
    *,
    group_index: int,
    first: int,
    optimizer_class: type[torch.optim.Optimizer],
    config: SwapConfig,
    compute_device: torch.device,
) -> list[Slot]:
    """The slots of ``group``'s parameters (param group ``group_index``, stepped by
    ``optimizer_class`` on ``compute_device``), numbered from ``first``. Raises
    ``ConfigError`` for a parameter whose memory is not contiguous."""
    probes: dict[torch.dtype, tuple[bool, dict[str, int]]] = {}
    names = group.get("param_names") or [None] * len(group["params"])
    slots: list[Slot] = []
    for param, name in zip(group["params"], names, strict=True):
        dtype = master_dtype(param)
        if dtype not in probes:
            probes[dtype] = probe_group(optimizer_class, group, dtype)
        if not local_tensor(param).is_contiguous():
            raise ConfigError(
                f"a parameter of shape {tuple(param.shape)} is not contiguous; tierswap "
                "steps flat slices of parameters: call .contiguous() on it before training"
            )
        cut, state = probes[dtype]
        whole = None if cut else whole_state(optimizer_class, group, param, name)
        streamed = config.offload_parameters
        if streamed:
            check_streamable(param, name)
        has_master = streamed or dtype != param.dtype or param.device.type != compute_device.type
        key = key_prefix(name) if name is not None else ""
        slots.append(
            Slot(
                first + len(slots), param, group_index, has_master,
                tuple(state.values()), name, key, state_names=tuple(state),
                whole_state=whole, precision=config.state_precision,
                remainder=config.master == "remainder" and param.dtype == torch.bfloat16,
                streamed=streamed, grads_in_memory=streamed and _grads_in_memory(config),
            )
        )  # fmt: skip
    return slots


def _grads_in_memory(config: SwapConfig) -> bool:
    """Whether streamed gradients go from backward to the step in memory alone: stepping in
    backward unchecked, one backward pass a step (passes that accumulate keep them in the
    swap space between them; a checked schedule keeps them to check and redo)."""
    return config.overlap == "backward" and config.accumulation_steps == 1


def check_streamable(param: torch.Tensor, name: str | None) -> None:
    """Raise ``ConfigError`` unless ``param`` can hold no memory between uses: a floating
    point tensor (not a DTensor shard) that owns its storage whole (or has none yet: built on the
    meta device), so that freeing the storage frees nothing else and refilling it restores
    every view autograd saved."""
    what = f"parameter {name!r}" if name else f"a parameter of shape {tuple(param.shape)}"
    if local_tensor(param) is not param:
        raise ConfigError(f"offload_parameters=True does not stream sharded parameters ({what})")
    if not param.dtype.is_floating_point:
        raise ConfigError(
            f"offload_parameters=True streams floating point parameters; {what} is {param.dtype}"
        )
    storage = param.untyped_storage()
    owned = storage.nbytes() in (0, param.numel() * param.element_size())  # 0: no values yet
    if param.storage_offset() != 0 or not owned:
        raise ConfigError(
            f"{what} is a view into a larger buffer (a flat parameter, or storage shared with "
            "another tensor); offload_parameters=True needs each parameter to own its memory"
        )


def inner_for(
    optimizer_class: type[torch.optim.Optimizer],
    inner: torch.optim.Optimizer,
    others: list[torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """The torch optimizer that steps groups of ``optimizer_class``: ``inner`` (the one the
    user named), one of ``others`` of that class, or a new one for a param group that names
    another class (made on a dummy tensor: its own groups are never used)."""
    if optimizer_class is type(inner):
        return inner
    for other in others:
        if type(other) is optimizer_class:
            return other
    dummy = torch.zeros(2, 2, requires_grad=True)
    made: torch.optim.Optimizer = optimizer_class([dummy])  # type: ignore[call-arg]
    return made
