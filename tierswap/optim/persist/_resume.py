"""Resumes: whether a commit fits this optimizer (format, world, parameters and param groups,
matched by name where they have names), and loading it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from tierswap.errors import ConfigError
from tierswap.optim._config import SwapConfig
from tierswap.optim.distributed import check_world
from tierswap.optim.persist._commit import layout_entry
from tierswap.optim.persist._parts import OptimizerParts
from tierswap.optim.plan import Slot, flat
from tierswap.pipeline import Region

__all__ = ["check_commit", "check_format", "match_groups", "match_keys", "restore_commit"]


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


def check_commit(parts: OptimizerParts, meta: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """Check that the commit ``meta`` describes can be resumed here (format, world, parameters,
    param groups), giving each slot its key in the commit. Returns, for each param group, the
    index of the committed group to restore it from, and the commit's scalars (read once, for
    :func:`restore_commit`). Raises ``ConfigError`` before anything but the slots' keys
    changes."""
    backend, slots, group_count = parts.backend, parts.layout.slots, len(parts.groups)
    check_format(parts.config, backend.path, meta)
    check_world(meta, backend.path)
    match_keys(slots, meta, backend.path)
    small = backend.load_small()
    order = match_groups(slots, group_count, meta, len(small["groups"]), backend.path)
    return order, small


def restore_commit(
    parts: OptimizerParts, *, saved_groups: list[int], small: dict[str, Any]
) -> None:
    """Load the last commit (checked by :func:`check_commit`, which read its scalars ``small``;
    the layout in its chunking): params (from masters or copies), scalars, hyper-parameters,
    step count."""
    backend, layout, step_state = parts.backend, parts.layout, parts.state
    index_of: dict[str | int, int] = {
        **{s.prefix: s.index for s in layout.slots},
        **{s.index: s.index for s in layout.slots},
    }  # positional blobs
    step_state.restore(
        {index_of[k]: v for k, v in small["small"].items()},
        {index_of[k]: v for k, v in small["names"].items()},
        small["steps"],
    )
    for group, saved in zip(parts.groups, saved_groups, strict=True):
        group.update(small["groups"][saved])
    with torch.no_grad():
        for piece in layout.slices:  # a slice at a time: the transient stays one slice
            for seg in piece.segments:
                slot = seg.slot
                if slot.streamed:  # its master is its value: read before each use
                    continue
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
    if layout != [layout_entry(s) for s in slots]:
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
    changed = sorted(n for n, s in current.items() if saved[n][0] != layout_entry(s))
    if changed:
        raise ConfigError(
            f"swap_dir {str(path)!r}: parameters {changed} changed shape, dtype or tier "
            "settings since the commit; resume with the same model and settings"
        )
    for name, slot in current.items():
        slot.key = saved[name][1]
