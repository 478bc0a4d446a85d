"""State dicts in torch's own format: ``state_dict()`` gathers the swapped state into CPU
tensors, ``load_state_dict()`` puts one into the swap space through torch's own checks."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, cast

import torch

from tierswap.optim.persist._arrays import master_of
from tierswap.optim.persist._bookkeeping import clone_state, hyper_parameters
from tierswap.optim.persist._parts import OptimizerParts
from tierswap.optim.plan import Slot, local_tensor, master_dtype

if TYPE_CHECKING:
    from tierswap.optim.persist._backend import StateBackend

__all__ = ["load_state_dict", "replace_states", "state_dict"]


def state_dict(optimizer: torch.optim.Optimizer, parts: OptimizerParts) -> dict[str, Any]:
    """torch's format: ``{"state": {index: {...}}, "param_groups": [...]}`` with CPU copies,
    made by torch's own ``Optimizer.state_dict`` on ``optimizer`` with the state filled in
    for the call (its ``state`` is empty before and after)."""
    backend, step_state = parts.backend, parts.state
    backend.pipeline.flush()
    for slot in parts.layout.slots:
        state = clone_state(step_state.small.get(slot.index, {}))
        for name in step_state.names[slot.index]:
            state[name] = _like_param(_read_state(backend, slot, name), slot.param)
        if state:
            optimizer.state[slot.param] = state
    try:
        result = torch.optim.Optimizer.state_dict(optimizer)
    finally:
        optimizer.state.clear()
    for group in result["param_groups"]:  # a class name, loadable with weights_only=True
        if isinstance(group.get("optimizer_class"), type):
            named = group["optimizer_class"]
            group["optimizer_class"] = f"{named.__module__}.{named.__qualname__}"
    return result


def _read_state(backend: StateBackend, slot: Slot, name: str) -> torch.Tensor:
    """State ``name`` of ``slot`` as torch keeps it: compact state decoded to fp32."""
    fmt = slot.moment_format(name)
    if fmt is None:
        value: torch.Tensor = backend.read(f"{slot.prefix}/{name}")
        return value
    stored = [backend.read(key).view(-1) for key in slot.state_keys(name)]
    return fmt.decode(stored, torch.empty(slot.local.shape, dtype=torch.float32))


def _stored_state(slot: Slot, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The arrays to store for state ``name`` of ``slot`` (keys to tensors): ``value`` as it
    is, or encoded in the slot's compact format (from its fp32 values)."""
    fmt = slot.moment_format(name)
    if fmt is None:
        return {f"{slot.prefix}/{name}": value}
    flat_value = value.detach().to("cpu", torch.float32).reshape(-1)
    numel = slot.local.numel()
    if flat_value.numel() != numel:
        raise ValueError(
            f"state {name!r} of parameter {slot.name or slot.prefix!r} has {flat_value.numel()} "
            f"elements, the parameter {numel}; load a state dict of the same model"
        )
    arrays = fmt.arrays(name, numel)
    stored = [torch.empty(a.numel, dtype=a.dtype) for a in arrays]
    fmt.encode(flat_value.contiguous(), stored)
    return dict(zip(slot.state_keys(name), stored, strict=True))


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """State of a DTensor parameter goes out as a DTensor sharded like it (torch's format)."""
    if local_tensor(param) is param:
        return local
    from torch.distributed.tensor import DTensor

    dtensor = cast(DTensor, param)  # local_tensor() unwrapped it: a DTensor
    return DTensor.from_local(
        local, dtensor.device_mesh, dtensor.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )  # fmt: skip


def load_state_dict(parts: OptimizerParts, saved: dict[str, Any]) -> None:
    """Load through the torch optimizers of the groups (``parts.inners``, one per group) so
    torch's own checks and casts apply (to the masters, on ``parts.compute_device``).

    Master weights are not part of torch's format: they are refreshed from the model params.
    All or nothing: when a write fails (disk full, ...) the optimizer is left as it was.
    """
    layout, step_state, param_groups = parts.layout, parts.state, parts.groups
    parts.backend.pipeline.evict()
    targets = [_load_target(s, parts.compute_device) for s in layout.slots]
    position = 0
    groups = []
    for group in param_groups:
        count = len(group["params"])
        groups.append({**group, "params": targets[position : position + count]})
        position += count
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    loaded_state: dict[torch.Tensor, Any] = {}
    loaded_groups: list[dict[str, Any]] = [{} for _ in groups]
    for inner, members in _groups_by_inner(parts.inners):
        ids = {i for m in members for i in saved_groups[m]["params"]}
        part = {
            "state": {k: v for k, v in saved.get("state", {}).items() if k in ids},
            "param_groups": [saved_groups[m] for m in members],
        }
        state, loaded = _load_into(inner, [groups[m] for m in members], part)
        loaded_state.update(state)
        for m, group in zip(members, loaded, strict=True):
            loaded_groups[m] = group
    states = [loaded_state.get(target, {}) for target in targets]
    replace_states(parts, list(zip(layout.slots, states, strict=True)))
    step_state.failed = False  # a whole state again
    step_state.params_written = set()  # the caller may have loaded weights: commit writes all
    for group, restored in zip(param_groups, loaded_groups, strict=True):
        group.update(hyper_parameters(restored))


def _groups_by_inner(
    inners: list[torch.optim.Optimizer],
) -> list[tuple[torch.optim.Optimizer, list[int]]]:
    """The param groups (by index) each torch optimizer steps: one class may load (and cast)
    only the state of its own groups."""
    by_inner: dict[int, tuple[torch.optim.Optimizer, list[int]]] = {}
    for index, inner in enumerate(inners):
        by_inner.setdefault(id(inner), (inner, []))[1].append(index)
    return list(by_inner.values())


def _load_into(
    inner: torch.optim.Optimizer, groups: list[dict[str, Any]], saved: dict[str, Any]
) -> tuple[dict[torch.Tensor, Any], list[dict[str, Any]]]:
    """``inner.load_state_dict(saved)`` onto ``groups``; the loaded state and groups, with
    ``inner`` left as it was."""
    own_groups = inner.param_groups
    inner.param_groups, inner.state = groups, defaultdict(dict)
    try:
        inner.load_state_dict(saved)
        return dict(inner.state), inner.param_groups
    finally:
        inner.param_groups, inner.state = own_groups, defaultdict(dict)


def _load_target(slot: Slot, compute_device: torch.device) -> torch.Tensor:
    """A tensor with the dtype and device the slot's state must have (torch casts to it)."""
    if not slot.has_master:
        return slot.local
    return torch.empty(0, dtype=master_dtype(slot.param), device=compute_device)


def replace_states(parts: OptimizerParts, states: list[tuple[Slot, dict[str, Any]]]) -> None:
    """Give each slot its new state, all or nothing: every tensor (and refreshed master) is
    written first, in one all-or-none put; only then are old names dropped and scalars set.
    8-bit scales get chunks of their own from the layout's chunking."""
    backend, step_state, chunk_bytes = parts.backend, parts.state, parts.layout.chunk_bytes
    tensors: dict[str, torch.Tensor] = {}
    chunks: dict[str, int] = {}
    names: dict[int, list[str]] = {}
    smalls: dict[int, dict[str, Any]] = {}
    for slot, state in states:
        names[slot.index], smalls[slot.index] = [], {}
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors.update(_stored_state(slot, name, local_tensor(value)))
                chunks.update(slot.chunk_overrides(name, chunk_bytes))
                names[slot.index].append(name)
            else:
                smalls[slot.index][name] = value
        if slot.has_master and not slot.streamed:  # on the host until the put ends
            # (a streamed parameter holds no values: its master is kept as it is)
            tensors[slot.master_key] = master_of(slot, slot.local)
        if slot.remainder:  # the parameter the zero remainder belongs to
            tensors[slot.param_key] = slot.local.detach().to("cpu")
    backend.put_many(tensors, chunks)
    for slot, _state in states:
        for name in step_state.names.pop(slot.index, []):
            if name not in names[slot.index]:
                for key in slot.state_keys(name):
                    backend.delete(key)
        if names[slot.index]:
            step_state.names[slot.index] = names[slot.index]
        step_state.small[slot.index] = smalls[slot.index]
