"""Commit / resume through the swap folder, and state dicts in torch's own format."""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from tierswap.errors import ConfigError, FailedStepError, StoreClosedError
from tierswap.optim._config import SwapConfig
from tierswap.optim.distributed import check_world, world_meta
from tierswap.optim.persist._bookkeeping import StepState
from tierswap.optim.plan import Layout, Slot, flat, local_tensor, master_dtype
from tierswap.pipeline import Region

if TYPE_CHECKING:
    from tierswap.optim.persist._backend import StateBackend

__all__ = [
    "SwappedState",
    "adopt_direct_state",
    "base_arrays",
    "check_commit",
    "check_format",
    "commit",
    "drain_writes",
    "final_commit",
    "load_state_dict",
    "master_of",
    "restore_commit",
    "state_dict",
    "write_params",
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


def write_params(
    backend: StateBackend, layout: Layout, slots: list[Slot], *, masters: bool
) -> None:
    """Write ``slots``' params that have no master (the committed copy) and, with
    ``masters``, the masters of the others (cast from the params); a slice at a time, so
    the transient stays within one slice."""
    chosen = {slot.index for slot in slots}
    for piece in layout.slices:
        writes: dict[Region, torch.Tensor] = {}
        for seg in piece.segments:
            slot, values = seg.slot, flat(seg.slot.param)[seg.start : seg.stop]
            if slot.index not in chosen:
                continue
            if slot.has_master and masters:
                writes[Region(slot.master_key, seg.start, seg.stop)] = master_of(slot, values)
            if slot.persists_param:
                writes[Region(slot.param_key, seg.start, seg.stop)] = values.detach().cpu()
        backend.put_regions(writes)


def check_format(config: SwapConfig, path: Any, meta: dict[str, Any]) -> None:
    """Raise ``ConfigError`` when the commit's ``state_precision`` or ``master`` differ from
    this optimizer's (folders from before compact state hold fp32)."""
    for setting, ours in (("state_precision", config.state_precision), ("master", config.master)):
        theirs = meta.get(setting, "fp32")
        if theirs != ours:
            raise ConfigError(
                f"swap_dir {str(path)!r} stores {setting}={theirs!r}, this "
                f"optimizer has {setting}={ours!r}; resume with {setting}={theirs!r}, or start a "
                "new swap_dir (load_state_dict converts a state dict to any format)"
            )


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


def commit(
    backend: StateBackend,
    layout: Layout,
    step_state: StepState,
    *,
    groups: list[dict[str, Any]],
    config: SwapConfig,
    optimizer_name: str,
) -> int:
    """Write params without a master (those the last step did not), scalars and
    hyper-parameters of ``groups``; flush the resident slices; commit. Returns the generation."""
    drain_writes(backend, step_state)
    if step_state.failed:
        committed = _steps_of(backend.committed_meta())
        raise FailedStepError(
            f"swap_dir {str(backend.path)!r}: a step failed part-way and left the state between "
            "two steps, so it is not committed; load a state (load_state_dict, load_snapshot) "
            f"or reopen with resume=True to continue from step {committed}"
        )
    slots = layout.slots
    unwritten = [s for s in slots if s.persists_param and s.index not in step_state.params_written]
    write_params(backend, layout, unwritten, masters=False)
    small = {  # keyed by each parameter's key prefix, so a resume can match by name
        "small": {s.prefix: _clone(step_state.small[s.index]) for s in slots},
        "names": {s.prefix: list(step_state.names[s.index]) for s in slots},
        "groups": [_hyper(g) for g in groups],
        "steps": step_state.steps,
    }
    meta = {
        "steps": step_state.steps,
        "optimizer": optimizer_name,
        "layout": [_entry(s) for s in slots],
        "keys": [s.prefix for s in slots],
        "names": [s.name for s in slots],
        "groups": [s.group for s in slots],  # a resume matches param groups by their members
        "chunk_bytes": layout.chunk_bytes,
        "state_precision": config.state_precision,
        "master": config.master,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **world_meta(),
    }
    generation = backend.commit(small, meta)
    step_state.changed = False  # the commit holds any state loaded before it
    return generation


def drain_writes(backend: StateBackend, step_state: StepState) -> None:
    """Wait for the steps' write-behinds; raise the first that failed.

    A failed write-behind lost a slice's new state (its buffers went back to the pool) and
    left the old one in the store, and the pipeline raises it only once: the state is marked
    ``failed`` first, so that no later commit at ``close()`` holds a mix of old and new.
    """
    try:
        backend.pipeline.drain()
    except BaseException:
        step_state.failed = True
        raise


def _steps_of(meta: dict[str, Any] | None) -> int:
    """The step count a commit's metadata holds (0: no commit yet)."""
    return 0 if meta is None else int(meta.get("steps", 0))


def final_commit(
    backend: StateBackend, config: SwapConfig, step_state: StepState, commit: Callable[[], object]
) -> None:
    """At ``close()``: call ``commit`` for the steps (or loaded state) since the last commit,
    where a resume can use the commit; warn when there are such steps that cannot be
    committed."""
    if backend.closed or not config.durable or config.swap_dir is None:
        return  # closed already, a scratch store, or a temporary folder that close() removes
    meta = backend.committed_meta()
    committed = _steps_of(meta)
    if committed == step_state.steps and not step_state.changed:
        return
    where = f"swap_dir {str(backend.path)!r}"
    world = world_meta()
    if meta is not None and any(meta.get(k, 0 if k == "rank" else 1) != world[k] for k in world):
        reason = "the torch.distributed process group was destroyed before close()"
    elif step_state.failed or step_state.plan is not None:
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
        commit()
    except Exception as exc:
        # The store closed under an open backend: a commit failed past its commit point (the
        # journal holds it), and the reopen of a resume finishes it.
        resume = (
            "resume=True finishes that commit and continues from the step it holds"
            if isinstance(exc, StoreClosedError)
            else f"resume=True continues from step {committed}"
        )
        warnings.warn(
            f"{where}: close() could not commit steps {committed + 1}..{step_state.steps} "
            f"({type(exc).__name__}: {exc}); {resume}",
            RuntimeWarning,
            stacklevel=3,
        )


def check_commit(
    backend: StateBackend, config: SwapConfig, slots: list[Slot], group_count: int,
    meta: dict[str, Any],
) -> tuple[list[int], dict[str, Any]]:  # fmt: skip
    """Check that the commit ``meta`` describes can be resumed here (format, world, parameters,
    param groups), giving each slot its key in the commit. Returns, for each of the
    ``group_count`` param groups, the index of the committed group to restore it from, and the
    commit's scalars (read once, for :func:`restore_commit`). Raises ``ConfigError`` before
    anything but the slots' keys changes."""
    check_format(config, backend.path, meta)
    check_world(meta, backend.path)
    match_keys(slots, meta, backend.path)
    small = backend.load_small()
    order = match_groups(slots, group_count, meta, len(small["groups"]), backend.path)
    return order, small


def restore_commit(
    backend: StateBackend,
    layout: Layout,
    step_state: StepState,
    groups: list[dict[str, Any]],
    *,
    saved_groups: list[int],
    small: dict[str, Any],
) -> None:
    """Load the last commit (checked by :func:`check_commit`, which read its scalars ``small``;
    ``layout`` in its chunking): params (from masters or copies), scalars, hyper-parameters,
    step count."""
    index_of: dict[str | int, int] = {
        **{s.prefix: s.index for s in layout.slots},
        **{s.index: s.index for s in layout.slots},
    }  # positional blobs
    step_state.restore(
        {index_of[k]: v for k, v in small["small"].items()},
        {index_of[k]: v for k, v in small["names"].items()},
        small["steps"],
    )
    for group, saved in zip(groups, saved_groups, strict=True):
        group.update(small["groups"][saved])
    with torch.no_grad():
        for piece in layout.slices:  # a slice at a time: the transient stays one slice
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


def state_dict(
    optimizer: torch.optim.Optimizer, backend: StateBackend, layout: Layout, step_state: StepState
) -> dict[str, Any]:
    """torch's format: ``{"state": {index: {...}}, "param_groups": [...]}`` with CPU copies,
    made by torch's own ``Optimizer.state_dict`` on ``optimizer`` with the state filled in
    for the call (its ``state`` is empty before and after)."""
    backend.pipeline.flush()
    for slot in layout.slots:
        state = _clone(step_state.small.get(slot.index, {}))
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


def load_state_dict(
    backend: StateBackend,
    layout: Layout,
    step_state: StepState,
    saved: dict[str, Any],
    *,
    inners: list[torch.optim.Optimizer],
    param_groups: list[dict[str, Any]],
    compute_device: torch.device,
) -> None:
    """Load through the torch optimizers of the groups (``inners``, one per group) so torch's
    own checks and casts apply (to the masters, on ``compute_device``).

    Master weights are not part of torch's format: they are refreshed from the model params.
    All or nothing: when a write fails (disk full, ...) the optimizer is left as it was.
    """
    backend.pipeline.evict()
    targets = [_load_target(s, compute_device) for s in layout.slots]
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
    for inner, members in _groups_by_inner(inners):
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
    _replace_states(
        backend, step_state, list(zip(layout.slots, states, strict=True)), layout.chunk_bytes
    )
    step_state.failed = False  # a whole state again
    step_state.params_written = set()  # the caller may have loaded weights: commit writes all
    for group, restored in zip(param_groups, loaded_groups, strict=True):
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


def _load_target(slot: Slot, compute_device: torch.device) -> torch.Tensor:
    """A tensor with the dtype and device the slot's state must have (torch casts to it)."""
    if not slot.has_master:
        return slot.local
    return torch.empty(0, dtype=master_dtype(slot.param), device=compute_device)


def _replace_states(
    backend: StateBackend,
    step_state: StepState,
    states: list[tuple[Slot, dict[str, Any]]],
    chunk_bytes: int,
) -> None:
    """Give each slot its new state, all or nothing: every tensor (and refreshed master) is
    written first, in one all-or-none put; only then are old names dropped and scalars set.
    ``chunk_bytes`` is the layout's chunking (8-bit scales get chunks of their own from it)."""
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
        if slot.has_master:  # on the host: all masters are held until the put ends
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


class SwappedState(defaultdict[torch.Tensor, dict[str, Any]]):
    """``SwapOptimizer.state``: empty between calls, because the state lives in the swap space.

    It is true whenever the swap space holds state (``step_state`` says), so torch's "is the state
    initialised?" check (``torch.distributed.checkpoint.state_dict`` takes a zero-gradient step
    otherwise) sees the state. Entries written into it directly, as ``ZeroRedundancyOptimizer.
    load_state_dict`` does to its local optimizer, move into the swap space at the next
    ``step()``, ``commit()`` or ``state_dict()`` (:func:`adopt_direct_state`).
    """

    def __init__(self, step_state: StepState | None = None) -> None:
        super().__init__(dict)
        self._step_state = step_state

    def __bool__(self) -> bool:
        held = self._step_state is not None and self._step_state.holds_state()
        return len(self) > 0 or held


def adopt_direct_state(
    direct: dict[torch.Tensor, dict[str, Any]], backend: StateBackend, layout: Layout,
    step_state: StepState,
) -> None:  # fmt: skip
    """Move state written straight into ``direct`` (the optimizer's ``state``) into the swap
    space, and empty it."""
    for param, state in list(dict.items(direct)):
        slot = layout.slot_of.get(id(param))
        if slot is None:
            raise ConfigError(
                f"optimizer.state holds a tensor of shape {tuple(param.shape)} that is not one "
                "of this optimizer's parameters; load state with load_state_dict()"
            )
        _replace_states(backend, step_state, [(slot, state)], layout.chunk_bytes)
    direct.clear()
