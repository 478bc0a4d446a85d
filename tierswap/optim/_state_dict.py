"""Commit / resume through the swap folder, and state dicts in torch's own format."""

from __future__ import annotations

import dataclasses
import datetime
import warnings
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any, cast

import torch

from tierswap.errors import ConfigError
from tierswap.optim._config import SwapConfig
from tierswap.optim._partition import Slot, local_tensor, master_dtype
from tierswap.optim._slice_step import flat
from tierswap.optim.distributed import check_world, world_meta
from tierswap.pipeline import Region

if TYPE_CHECKING:
    from tierswap.optim.optimizer import SwapOptimizer

__all__ = [
    "SwappedState",
    "adopt_direct_state",
    "base_arrays",
    "check_format",
    "commit",
    "load_state_dict",
    "master_of",
    "restore_commit",
    "state_dict",
]


def base_arrays(slot: Slot) -> list[tuple[str, torch.dtype]]:
    """The arrays every slot has from the start (key, dtype; in the parameter's shape): its
    master (fp32, or the int16 remainder) and its committed copy of the parameter."""
    arrays = []
    if slot.has_master:
        arrays.append(
            (slot.master_key, torch.int16 if slot.remainder else master_dtype(slot.param))
        )
    if slot.persists_param:
        arrays.append((slot.param_key, slot.param.dtype))
    return arrays


def master_of(slot: Slot, values: torch.Tensor) -> torch.Tensor:
    """The stored master (CPU) of a slot whose master is the parameter ``values``: its fp32
    cast, or a remainder of zeros (``split(param.float())`` leaves nothing over)."""
    if slot.remainder:
        return torch.zeros(values.shape, dtype=torch.int16)
    return values.detach().to("cpu", master_dtype(slot.param))


def check_format(optimizer: SwapOptimizer, meta: dict[str, Any]) -> None:
    """Raise ``ConfigError`` when the commit's ``state_precision`` or ``master`` differ from
    this optimizer's (folders from before compact state hold fp32)."""
    config = optimizer._config
    for setting, ours in (("state_precision", config.state_precision), ("master", config.master)):
        theirs = meta.get(setting, "fp32")
        if theirs != ours:
            raise ConfigError(
                f"swap_dir {str(optimizer._backend.path)!r} stores {setting}={theirs!r}, this "
                f"optimizer has {setting}={ours!r}; resume with {setting}={theirs!r}, or start a "
                "new swap_dir (load_state_dict converts a state dict to any format)"
            )


def _layout(optimizer: SwapOptimizer) -> list[list[Any]]:
    return [_entry(s) for s in optimizer._slots]


def _entry(slot: Slot) -> list[Any]:
    """What must match between a slot and the parameter of a commit it resumes."""
    return [list(slot.local.shape), str(master_dtype(slot.param)), slot.has_master]


#: Not hyper-parameters: a group's parameters and their names, the optimizer class a group
#: names, and settings of this run (ZeroRedundancyOptimizer copies its constructor keywords,
#: swap_dir, host_budget, ..., into every param group). A class or a Path among them would make
#: the committed blob unloadable with ``torch.load(weights_only=True)``.
_NOT_HYPER = frozenset(
    ("params", "param_names", "optimizer_class", *(f.name for f in dataclasses.fields(SwapConfig)))
)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


#: What a commit stores of a param group (its hyper-parameters), for comparisons.
hyper_parameters = _hyper


def commit(optimizer: SwapOptimizer) -> int:
    """Write params without a master (those the last step did not), scalars and
    hyper-parameters; flush the resident slices; commit."""
    adopt_direct_state(optimizer)
    optimizer._backend.pipeline.drain()
    written = optimizer._params_written
    unwritten = [s for s in optimizer._slots if s.persists_param and s.index not in written]
    optimizer.write_from_params(unwritten, masters=False)
    slots = optimizer._slots
    small = {  # keyed by each parameter's key prefix, so a resume can match by name
        "small": {s.prefix: _clone(optimizer._small[s.index]) for s in slots},
        "names": {s.prefix: list(optimizer._state_names[s.index]) for s in slots},
        "groups": [_hyper(g) for g in optimizer.param_groups],
        "steps": optimizer._steps,
    }
    meta = {
        "steps": optimizer._steps,
        "optimizer": type(optimizer._inner).__name__,
        "layout": _layout(optimizer),
        "keys": [s.prefix for s in slots],
        "names": [s.name for s in slots],
        "groups": [s.group for s in slots],  # a resume matches param groups by their members
        "chunk_bytes": optimizer._chunk_bytes,
        "state_precision": optimizer._config.state_precision,
        "master": optimizer._config.master,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **world_meta(),
    }
    generation = optimizer._backend.commit(small, meta)
    optimizer._snapshot_changed = False  # the commit holds any state loaded before it
    return generation


def final_commit(optimizer: SwapOptimizer) -> None:
    """At ``close()``: commit the steps (or loaded state) since the last commit, where a
    resume can use the commit; warn when there are such steps that cannot be committed."""
    backend = optimizer._backend
    config = optimizer._config
    if backend.closed or not config.durable or config.swap_dir is None:
        return  # closed already, a scratch store, or a temporary folder that close() removes
    meta = backend.committed_meta()
    committed = 0 if meta is None else int(meta.get("steps", 0))
    if committed == optimizer.steps and not optimizer._snapshot_changed:
        return
    where = f"swap_dir {str(backend.path)!r}"
    world = world_meta()
    if meta is not None and any(meta.get(k, 0 if k == "rank" else 1) != world[k] for k in world):
        reason = "the torch.distributed process group was destroyed before close()"
    elif optimizer._step_failed or optimizer._plan_of_step is not None:
        reason = "a step failed (or is under way) and left the state between two steps"
    else:
        reason = ""
    if reason:
        warnings.warn(
            f"{where}: steps after step {committed} were not committed, because {reason}; "
            f"resume=True continues from step {committed}",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    try:
        commit(optimizer)
    except Exception as exc:
        warnings.warn(
            f"{where}: close() could not commit steps {committed + 1}..{optimizer.steps} "
            f"({type(exc).__name__}: {exc}); resume=True continues from step {committed}",
            RuntimeWarning,
            stacklevel=3,
        )


def restore_commit(optimizer: SwapOptimizer, meta: dict[str, Any]) -> None:
    """Load the last commit: params (from masters or copies), scalars, groups, step count."""
    backend = optimizer._backend
    check_format(optimizer, meta)
    check_world(meta, backend.path)
    match_keys(optimizer._slots, meta, backend.path)
    small = backend.load_small()
    saved_groups = match_groups(
        optimizer._slots, len(optimizer.param_groups), meta, len(small["groups"]), backend.path
    )  # checked before anything changes: a refused resume leaves optimizer and folder alone
    chunk = meta.get("chunk_bytes")
    if chunk and chunk != optimizer._chunk_bytes:  # slices must follow the stored chunking
        optimizer._chunk_bytes = chunk
        optimizer._plan()
    by_prefix: dict[str | int, int] = {s.prefix: s.index for s in optimizer._slots}
    index_of: dict[str | int, int] = {
        **by_prefix,
        **{s.index: s.index for s in optimizer._slots},
    }  # positional blobs
    optimizer._small = defaultdict(dict, {index_of[k]: v for k, v in small["small"].items()})
    optimizer._state_names = defaultdict(list, {index_of[k]: v for k, v in small["names"].items()})
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update(small["groups"][saved])
    optimizer._steps = small["steps"]
    with torch.no_grad():
        for piece in optimizer._slices:  # a slice at a time: the transient stays one slice
            for seg in piece.segments:
                slot = seg.slot
                values = backend.read_region(Region(slot.restore_key, seg.start, seg.stop))
                flat(slot.param)[seg.start : seg.stop].copy_(values)


def match_keys(slots: list[Slot], meta: dict[str, Any], path: Any) -> None:
    """Give each slot the key of its parameter in the commit ``meta`` describes, or raise.

    By name when both the commit and this optimizer name their parameters (the order may
    differ); else by position (a folder written before names existed, or unnamed parameters),
    with each slot taking the commit's key at its position.
    """
    layout = meta.get("layout", [])
    saved_names = meta.get("names") or [None] * len(layout)
    saved_keys = meta.get("keys") or [f"p{i}" for i in range(len(layout))]
    if all(saved_names) and saved_names and all(s.name is not None for s in slots):
        _match_by_name(slots, layout, saved_names, saved_keys, path)
        return
    if layout != [_entry(s) for s in slots]:
        raise ConfigError(
            f"swap_dir {str(path)!r} holds a run with another parameter layout "
            f"({len(layout)} params, optimizer {meta.get('optimizer')}); resume with the same "
            "model, param groups and tier settings, or use a new swap_dir"
        )
    for slot, key in zip(slots, saved_keys, strict=True):
        slot.key = key


def match_groups(
    slots: list[Slot], count: int, meta: dict[str, Any], saved_count: int, path: Any
) -> list[int]:
    """For each of the ``count`` param groups here, the index of the committed group that holds
    the same parameters (call :func:`match_keys` first), or raise ``ConfigError``.

    Parameters are identified by their keys, so named groups match by the names of their
    parameters (the groups' order may change) and positional ones by position. A folder
    committed before groups were recorded matches by position.
    """
    saved_of = meta.get("groups")
    if saved_of is None:
        if saved_count != count:
            raise ConfigError(
                f"swap_dir {str(path)!r} was committed with {saved_count} param groups, this "
                f"optimizer has {count}; resume with the same param groups, or use a new swap_dir"
            )
        return list(range(count))
    keys = meta.get("keys") or [f"p{i}" for i in range(len(saved_of))]
    saved: list[set[str]] = [set() for _ in range(saved_count)]
    for key, group in zip(keys, saved_of, strict=True):
        saved[group].add(key)
    here: list[set[str]] = [set() for _ in range(count)]
    for slot in slots:
        here[slot.group].add(slot.prefix)
    candidates: dict[frozenset[str], list[int]] = defaultdict(list)
    for index, members in enumerate(saved):
        candidates[frozenset(members)].append(index)
    order = [
        candidates[frozenset(members)].pop(0) for members in here if candidates[frozenset(members)]
    ]
    if len(order) != count or count != saved_count:
        _refuse_regrouping(slots, here, saved, path)
    return order


def _refuse_regrouping(
    slots: list[Slot], here: list[set[str]], saved: list[set[str]], path: Any
) -> None:
    """Raise the ``ConfigError`` of param groups that hold other parameters than the commit's,
    naming the parameters (up to ten) whose group-mates changed."""
    mates = {key: members for members in saved for key in members}
    display = {s.prefix: s.name if s.name is not None else s.prefix for s in slots}
    moved = [display[k] for members in here for k in sorted(members) if mates.get(k) != members]
    shown = ", ".join(repr(name) for name in moved[:10]) + (", ..." if len(moved) > 10 else "")
    raise ConfigError(
        f"swap_dir {str(path)!r} was committed with other param groups ({len(saved)} groups, "
        f"here {len(here)}): the parameters [{shown}] were grouped otherwise; resume with the "
        "same parameters in each group (the groups' order may change), or use a new swap_dir"
    )


def _match_by_name(
    slots: list[Slot], layout: list[Any], names: list[str], keys: list[str], path: Any
) -> None:
    saved = {name: (entry, key) for name, entry, key in zip(names, layout, keys, strict=True)}
    current = {s.name: s for s in slots if s.name is not None}  # the caller checked: all
    missing, unexpected = sorted(saved.keys() - current.keys()), sorted(current.keys() - saved)
    if missing or unexpected:
        raise ConfigError(
            f"swap_dir {str(path)!r} holds other parameters: missing here {missing}, not in the "
            f"folder {unexpected}; resume with the same model, or use a new swap_dir"
        )
    changed = sorted(n for n, s in current.items() if saved[n][0] != _entry(s))
    if changed:
        raise ConfigError(
            f"swap_dir {str(path)!r}: parameters {changed} changed shape, dtype or tier "
            "settings since the commit; resume with the same model and settings"
        )
    for name, slot in current.items():
        slot.key = saved[name][1]


def _clone(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value.clone() if torch.is_tensor(value) else value


def state_dict(optimizer: SwapOptimizer) -> dict[str, Any]:
    """torch's format: ``{"state": {index: {...}}, "param_groups": [...]}`` with CPU copies."""
    adopt_direct_state(optimizer)
    backend = optimizer._backend
    backend.pipeline.flush()
    for slot in optimizer._slots:
        state = _clone(optimizer._small.get(slot.index, {}))
        for name in optimizer._state_names[slot.index]:
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


def _read_state(backend: Any, slot: Slot, name: str) -> torch.Tensor:
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


def load_state_dict(optimizer: SwapOptimizer, saved: dict[str, Any]) -> None:
    """Load through the inner optimizer so torch's own checks and casts apply (to the masters).

    Master weights are not part of torch's format: they are refreshed from the model params.
    All or nothing: when a write fails (disk full, ...) the optimizer is left as it was.
    """
    optimizer._backend.pipeline.evict()
    targets = [_load_target(optimizer, s) for s in optimizer._slots]
    position = 0
    groups = []
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append({**group, "params": targets[position : position + count]})
        position += count
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    loaded_state: dict[torch.Tensor, Any] = {}
    loaded_groups: list[dict[str, Any]] = [{} for _ in groups]
    for inner, members in _groups_by_inner(optimizer._inners):
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
    _replace_states(optimizer, list(zip(optimizer._slots, states, strict=True)))
    for group, restored in zip(optimizer.param_groups, loaded_groups, strict=True):
        group.update(_hyper(restored))


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


def _load_target(optimizer: SwapOptimizer, slot: Slot) -> torch.Tensor:
    """A tensor with the dtype and device the slot's state must have (torch casts to it)."""
    if not slot.has_master:
        return slot.local
    return torch.empty(0, dtype=master_dtype(slot.param), device=optimizer.compute_device)


def _replace_state(optimizer: SwapOptimizer, slot: Slot, state: dict[str, Any]) -> None:
    _replace_states(optimizer, [(slot, state)])


def _replace_states(optimizer: SwapOptimizer, states: list[tuple[Slot, dict[str, Any]]]) -> None:
    """Give each slot its new state, all or nothing: every tensor (and refreshed master) is
    written first, in one all-or-none put; only then are old names dropped and scalars set."""
    backend = optimizer._backend
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, list[str]] = {}
    smalls: dict[int, dict[str, Any]] = {}
    for slot, state in states:
        names[slot.index], smalls[slot.index] = [], {}
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors.update(_stored_state(slot, name, local_tensor(value)))
                names[slot.index].append(name)
            else:
                smalls[slot.index][name] = value
        if slot.has_master:  # on the host: all masters are held until the put ends
            tensors[slot.master_key] = master_of(slot, slot.local)
        if slot.remainder:  # the parameter the zero remainder belongs to
            tensors[slot.param_key] = slot.local.detach().to("cpu")
    backend.put_many(tensors)
    for slot, _state in states:
        for name in optimizer._state_names.pop(slot.index, []):
            if name not in names[slot.index]:
                for key in slot.state_keys(name):
                    backend.delete(key)
        if names[slot.index]:
            optimizer._state_names[slot.index] = names[slot.index]
        optimizer._small[slot.index] = smalls[slot.index]


class SwappedState(defaultdict[torch.Tensor, dict[str, Any]]):
    """``SwapOptimizer.state``: empty between calls, because the state lives in the swap space.

    It is true whenever the swap space holds state, so torch's "is the state initialised?"
    check (``torch.distributed.checkpoint.state_dict`` takes a zero-gradient step otherwise)
    sees the state. Entries written into it directly, as ``ZeroRedundancyOptimizer.
    load_state_dict`` does to its local optimizer, move into the swap space at the next
    ``step()``, ``commit()`` or ``state_dict()`` (:func:`adopt_direct_state`).
    """

    def __init__(self, optimizer: SwapOptimizer | None = None) -> None:
        super().__init__(dict)
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None

    def __bool__(self) -> bool:
        optimizer = self._optimizer() if self._optimizer is not None else None
        if len(self) or optimizer is None:
            return len(self) > 0
        return any(optimizer._state_names.values()) or any(optimizer._small.values())


def adopt_direct_state(optimizer: SwapOptimizer) -> None:
    """Move state written straight into ``optimizer.state`` into the swap space."""
    for param, state in list(dict.items(optimizer.state)):
        slot = optimizer._slot_of.get(id(param))
        if slot is None:
            raise ConfigError(
                f"optimizer.state holds a tensor of shape {tuple(param.shape)} that is not one "
                "of this optimizer's parameters; load state with load_state_dict()"
            )
        _replace_state(optimizer, slot, state)
    optimizer.state.clear()
