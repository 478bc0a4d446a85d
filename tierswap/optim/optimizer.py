"""SwapOptimizer: any torch optimizer with its state (and fp32 masters) in a tier cache.

The optimizer the user names (``optimizer_class``) is instantiated once as the *inner*
optimizer. Each ``step()`` walks the partitions in schedule order; for each it pins the
partition's tensors in the cache, points the inner optimizer's ``param_groups`` and ``state``
at them, runs the inner ``step()`` (so torch picks the same for-loop, foreach or fused kernel it
would pick in memory) and hands the tensors back, dirty. Per-element math is independent across
tensors in every torch optimizer this supports, so stepping in partitions is bitwise equal to
stepping all at once.
"""

from __future__ import annotations

import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tierswap.cache.policies import EvictionPolicy
from tierswap.errors import ConfigError
from tierswap.optim import _hooks, _snapshot, _state_dict
from tierswap.optim._backend import StateBackend
from tierswap.optim._config import SwapConfig
from tierswap.optim._memory import trim_heap
from tierswap.optim._partition import (
    Partition,
    Slot,
    check_budget,
    local_tensor,
    master_dtype,
    partition_slots,
    probe_state_itemsizes,
)
from tierswap.optim.distributed import check_resumed_steps
from tierswap.store.snapshot import Progress, SnapshotResult

__all__ = ["SwapOptimizer"]

#: Upper bound of one partition's working set: small enough to pipeline, large enough that
#: the per-partition overhead (a few Python calls) stays negligible.
MAX_PARTITION_BYTES = 128 << 20
#: Partition size when all state stays resident.
RESIDENT_PARTITION_BYTES = 512 << 20
#: How many partitions ahead ``step()`` prefetches while stepping one.
PREFETCH_DEPTH = 2


class SwapOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose state lives in a GPU / host / NVMe tier cache.

    Parameters
    ----------
    params:
        Parameters or param groups, as for any torch optimizer.
    optimizer_class:
        The torch optimizer to run (``torch.optim.AdamW``, ``SGD``, ``Adagrad``, ...); any with
        per-parameter tensor state and no cross-parameter math.
    swap_dir:
        Folder of the swap store. ``None``: a temporary folder removed by :meth:`close`.
        Under ``torch.distributed`` each rank uses ``swap_dir/rank-<r>``.
    host_budget, device_budget:
        Byte budgets of the host and device tiers (ints or strings such as ``"4GiB"``).
        ``host_budget=None`` keeps all state in RAM; ``device_budget=0`` turns the device tier
        off. A budget below the largest partition's working set raises ``ConfigError``.
    policy:
        Eviction policy of the cache (``"lookahead"``, ``"lru"`` or a policy instance).
    durable:
        Passed to the store: ``False`` writes in place, faster but not crash-safe.
    commit_every:
        Commit the swap folder atomically every this many steps (0: only on :meth:`commit`).
    resume:
        Load master weights into the model params and restore state and step counts from the
        last commit in ``swap_dir``.
    resume_from:
        A snapshot (:meth:`snapshot`, or a trainer checkpoint's ``optimizer.tierswap`` folder)
        to resume from: ``swap_dir`` is replaced by hard links to it (a copy across
        filesystems), then the run resumes as with ``resume=True``. The snapshot is not changed.
    overlap:
        ``"backward"`` steps each parameter in its post-accumulate-grad hook as soon as its
        gradient is final (every ``accumulation_steps`` backward passes). It cannot honour
        global gradient clipping or ``GradScaler``: the step happens before they could run.
    **optimizer_kwargs:
        Passed to ``optimizer_class`` (``lr``, ``betas``, ``weight_decay``, ``fused``, ...).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        swap_dir: str | os.PathLike[str] | None = None,
        host_budget: int | str | None = None,
        device_budget: int | str = 0,
        policy: str | EvictionPolicy = "lookahead",
        durable: bool = True,
        commit_every: int = 1,
        resume: bool = False,
        overlap: str | None = None,
        accumulation_steps: int = 1,
        resume_from: str | os.PathLike[str] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        config = SwapConfig(
            swap_dir, host_budget, device_budget, policy, durable, commit_every, resume, overlap,
            accumulation_steps, resume_from=resume_from,
        )  # fmt: skip
        _check_class(optimizer_class)
        self._setup(optimizer_class(params, **optimizer_kwargs), config)

    # -- construction ---------------------------------------------------------------------
    def _setup(self, inner: torch.optim.Optimizer, config: SwapConfig) -> None:
        self._ready = False
        self._inner = inner
        # State the inner optimizer already holds (eager init as in Adagrad, or an optimizer
        # handed to offload()) moves into the swap space through load_state_dict below.
        existing = inner.state_dict() if inner.state else None
        self._config = config
        super().__init__(inner.param_groups, inner.defaults)
        self.state = _state_dict.SwappedState(self)  # true when the swap space holds state
        self._inner_groups = inner.param_groups
        self._slots: list[Slot] = []
        self._small: dict[int, dict[str, Any]] = defaultdict(dict)
        self._state_names: dict[int, list[str]] = defaultdict(list)
        self._steps = 0
        self._stepped: set[int] = set()
        self.tier = "device" if config.device_budget > 0 else "host"
        self.compute_device = _compute_device(self.tier)
        for group in self.param_groups:
            self._add_slots(group)
        self._repartition()
        if config.resume_from is not None and config.swap_dir is not None:
            _snapshot.seed_swap_dir(config.swap_dir, config.resume_from)
        self._backend = StateBackend(
            config.swap_dir,
            tier=self.tier,
            host_budget=self.host_budget,
            device_budget=config.device_budget,
            policy=self._policy(),
            durable=config.durable,
            resume=config.resume,
        )
        # Closes the cache and store (and removes a temporary folder) when the optimizer is
        # garbage-collected without close(). Not at interpreter exit: the I/O pools are gone by
        # then; no background work is left between steps, so nothing is lost.
        self._finalizer = weakref.finalize(self, self._backend.close)
        self._finalizer.atexit = False
        try:
            self._start(config.resume)
            if config.resume:  # every rank must resume the same step (a collective)
                check_resumed_steps(self._steps, self._backend.path)
        except BaseException:
            self._finalizer()
            raise
        self._hook_handles = _hooks.register(self)
        self._ready = True
        inner.state = defaultdict(dict)  # only now: a failed construction leaves it intact
        if existing is not None and not config.resume:
            self.load_state_dict(existing)

    def _add_slots(self, group: dict[str, Any]) -> None:
        group_index = next(i for i, g in enumerate(self.param_groups) if g is group)
        probes: dict[torch.dtype, tuple[int, ...]] = {}
        for param in group["params"]:
            dtype = master_dtype(param)
            if dtype not in probes:
                probes[dtype] = _probe(self._inner, group, dtype)
            has_master = dtype != param.dtype or param.device.type != self.compute_device.type
            self._slots.append(
                Slot(len(self._slots), param, group_index, has_master, probes[dtype])
            )

    def _repartition(self) -> None:
        """Partition the slots in schedule order and check them against the budgets."""
        total = sum(s.working_set for s in self._slots)
        if not hasattr(self, "_backend"):  # the cache's budget is fixed once it exists
            configured = self._config.host_budget
            self.host_budget = configured if configured is not None else max(total, 1)
        budget = self.host_budget
        if self.tier == "device":
            budget = min(budget, self._config.device_budget)
        # All state resident: large partitions (no I/O to pipeline; fewer calls), bounded so the
        # first step's freshly created state is copied into the cache a slice at a time. Else
        # about a sixth of the budget: reads ahead, the step and writes behind fit at once.
        if total <= budget:
            target = RESIDENT_PARTITION_BYTES
        else:
            target = min(max(budget // 6, 1), MAX_PARTITION_BYTES)
        self._partitions: list[Partition] = partition_slots(self._slots[::-1], target)
        self._evict_after = _write_behind(self._partitions, budget)
        check_budget(self._partitions, self.host_budget, "host_budget")
        if self.tier == "device":
            check_budget(self._partitions, self._config.device_budget, "device_budget")
        self._slot_partition = {s.index: p for p in self._partitions for s in p.slots}
        self._slot_of = {id(s.param): s for s in self._slots}

    def _policy(self) -> Any:
        """The cache policy; when all state fits, eviction never happens and plain LRU (the
        cheapest bookkeeping) stands in for the default lookahead."""
        fits = sum(s.working_set for s in self._slots) <= self._tier_budget()
        return "lru" if fits and self._config.policy == "lookahead" else self._config.policy

    def _start(self, resume: bool) -> None:
        meta = self._backend.committed_meta() if resume else None
        if meta is not None:
            _state_dict.restore_commit(self, meta)
            return
        for slot in self._slots:
            if slot.has_master and slot.master_key not in self._backend.known:
                self._backend.put(slot.master_key, _master_copy(slot, self.compute_device))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch does); its state is swapped like the others."""
        ready = getattr(self, "_ready", False)
        if ready and self._config.resume and self._steps:
            raise ConfigError("add_param_group after resuming a run is not supported")
        super().add_param_group(param_group)
        if not ready:
            return
        count = len(self._slots)
        self._add_slots(self.param_groups[-1])
        try:
            self._repartition()
        except ConfigError:  # the new group does not fit the budget: leave things as they were
            del self._slots[count:]
            self.param_groups.pop()
            self._repartition()
            raise
        self._start(resume=False)
        _hooks.remove(self._hook_handles)
        self._hook_handles = _hooks.register(self)

    # -- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every parameter that has a gradient, partition by partition; commit when due."""
        _state_dict.adopt_direct_state(self)  # e.g. from ZeroRedundancyOptimizer.load_state_dict
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [
            (part, [s for s in part.slots if self._ready_to_step(s)]) for part in self._partitions
        ]
        work = [(part, live) for part, live in work if live]
        self._backend.settle()
        for position, (part, live) in enumerate(work):
            self._prefetch_ahead(work, position)
            self._step_slots(live)
            if part.index in self._evict_after:
                self._backend.evict_behind(self._keys(part.slots))
        self._backend.settle()  # the last writes finish here: nothing runs between steps
        self._stepped.clear()
        _hooks.new_cycle(self)
        self._steps += 1
        every = self._config.commit_every
        if every and self._steps % every == 0:
            self.commit()
        return loss

    def _ready_to_step(self, slot: Slot) -> bool:
        return slot.param.grad is not None and slot.index not in self._stepped

    def _prefetch_ahead(self, work: list[tuple[Partition, list[Slot]]], position: int) -> None:
        """Ask the cache for the next partitions' tensors while this one steps."""
        room = self._tier_budget() - work[position][0].working_set
        for part, live in work[position + 1 : position + 1 + PREFETCH_DEPTH]:
            if part.working_set > room:
                break
            room -= part.working_set
            self._backend.prefetch(self._keys(live))

    def _tier_budget(self) -> int:
        if self.tier == "device":
            return min(self.host_budget, self._config.device_budget)
        return self.host_budget

    def _keys(self, slots: Iterable[Slot]) -> list[str]:
        keys = []
        for slot in slots:
            keys += [f"{slot.prefix}/{name}" for name in self._state_names[slot.index]]
            if slot.has_master:
                keys.append(slot.master_key)
        return keys

    def _step_slots(self, live: list[Slot]) -> None:
        """Run the inner optimizer over ``live`` with their tensors pinned in the cache."""
        with self._backend.hold(self._keys(live)) as held:
            targets = {s.index: held[s.master_key] if s.has_master else s.local for s in live}
            state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
            for slot in live:
                target = targets[slot.index]
                grad = local_tensor(slot.param.grad)
                if slot.has_master:
                    target.grad = grad.to(target.device, target.dtype)
                elif target is not slot.param:  # a DTensor's local shard
                    target.grad = grad
                state[target] = self._slot_state(slot, held)
            self._inner.state = state
            self._inner.param_groups = self._groups_for(live, targets)
            try:
                self._inner.step()
                if self.compute_device.type == "cuda":
                    # Sync point: the step's kernels must finish before the tensors are
                    # unpinned, since the cache may then copy them down on its own stream.
                    torch.cuda.current_stream(self.compute_device).synchronize()
            finally:
                self._inner.param_groups = self._inner_groups
                self._inner.state = defaultdict(dict)
            created = [
                self._collect(slot, targets[slot.index], state[targets[slot.index]], held)
                for slot in live
            ]
        if any(created):
            trim_heap()  # the freshly created state was copied into the cache: free it for real

    def _slot_state(self, slot: Slot, held: dict[str, torch.Tensor]) -> dict[str, Any]:
        state = dict(self._small.get(slot.index, {}))
        for name in self._state_names[slot.index]:
            state[name] = held[f"{slot.prefix}/{name}"]
        return state

    def _groups_for(
        self, live: list[Slot], targets: dict[int, torch.Tensor]
    ) -> list[dict[str, Any]]:
        """Shallow copies of the live slots' groups holding the tensors to step."""
        by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
        for slot in live:
            by_group[slot.group].append(targets[slot.index])
        return [{**self.param_groups[g], "params": by_group[g]} for g in sorted(by_group)]

    def _collect(
        self,
        slot: Slot,
        target: torch.Tensor,
        new_state: dict[str, Any],
        held: dict[str, torch.Tensor],
    ) -> bool:
        """Hand the stepped tensors back to the cache; keep scalars; update the model param.

        Returns whether the step created new state tensors (they were copied into the cache).
        """
        small: dict[str, Any] = {}
        created = False
        for name, value in new_state.items():
            key = f"{slot.prefix}/{name}"
            if not (torch.is_tensor(value) and value.dim() > 0):
                small[name] = value
            elif key in held:
                if value is not held[key]:
                    held[key].copy_(value)
                self._backend.mark_dirty(key)
            else:
                self._backend.put(key, value)
                self._state_names[slot.index].append(name)
                created = True
        self._small[slot.index] = small
        if target is not slot.param:
            target.grad = None
        if slot.has_master:
            self._backend.mark_dirty(slot.master_key)
            slot.local.copy_(target)  # blocking: the master may be evicted right after
        return created

    # -- persistence and state dicts ------------------------------------------------------
    def commit(self) -> int:
        """Make the current masters, state and step count the folder's atomic restart point."""
        return _state_dict.commit(self)

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's own format (materialised in host RAM, as CPU tensors).

        After :meth:`redirect_state_dict`, the next call instead takes a snapshot and returns
        the small reference dict of :meth:`snapshot_state_dict`.
        """
        redirected = _snapshot.redirected_state_dict(self)
        return redirected if redirected is not None else _state_dict.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in torch's format (from this class or the plain optimizer), or a
        snapshot reference from :meth:`snapshot_state_dict`."""
        if _snapshot.is_reference(state_dict):
            _snapshot.load_reference(self, state_dict)
        else:
            _state_dict.load_state_dict(self, state_dict)
            _snapshot.mark_changed(self)

    # -- snapshots (see tierswap.optim._snapshot) -------------------------------------------
    def snapshot(
        self, dest: str | os.PathLike[str], *, progress: bool | Progress | None = None
    ) -> SnapshotResult:
        """Keep the current state as a standalone store in the new or empty ``dest``: hard
        links to the swap folder's files (no data copied), a copy across filesystems. Commits
        first unless the last commit already holds this state (``commit_every`` did it)."""
        return _snapshot.snapshot(self, dest, progress=progress)

    def snapshot_state_dict(self, dest: str | os.PathLike[str]) -> dict[str, Any]:
        """:meth:`snapshot` into ``dest`` and return a small dict referencing it, which
        :meth:`load_state_dict` accepts (a trainer checkpoint that never materialises)."""
        return _snapshot.reference(self, dest)

    def redirect_state_dict(self, dest: str | os.PathLike[str] | None) -> None:
        """Make the next :meth:`state_dict` call return :meth:`snapshot_state_dict` of ``dest``
        (``None`` cancels). For trainers that save ``optimizer.state_dict()`` themselves."""
        _snapshot.redirect(self, dest)

    def load_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Replace the swap folder by the snapshot at ``path`` and resume from it."""
        _snapshot.load_snapshot(self, path)

    # -- introspection and teardown -------------------------------------------------------
    @property
    def swap_dir(self) -> Path:
        """The folder of the swap store."""
        return self._backend.path

    @property
    def steps(self) -> int:
        """Number of ``step()`` calls, counted across resumes."""
        return self._steps

    @property
    def partitions(self) -> list[Partition]:
        return list(self._partitions)

    def tier_stats(self) -> dict[str, Any]:
        """The cache's statistics (hits, misses, bytes per tier, stall time) as a dict."""
        return self._backend.stats()

    def close(self) -> None:
        """Release hooks, cache and store; a temporary swap folder is removed."""
        _hooks.remove(getattr(self, "_hook_handles", []))
        self._hook_handles = []
        self._finalizer()

    def __enter__(self) -> SwapOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SwapOptimizer({type(self._inner).__name__}, params={len(self._slots)}, "
            f"partitions={len(self._partitions)}, tier={self.tier!r}, "
            f"host_budget={self.host_budget}, swap_dir={str(self._backend.path)!r})"
        )


def _write_behind(partitions: list[Partition], budget: int) -> set[int]:
    """Partitions to write back and drop right after they step, when the state exceeds ``budget``.

    In a cyclic schedule the optimal victim is the partition just stepped (Belady evicts what is
    used furthest ahead). The first partitions, up to a third of the budget, stay resident: the
    next step starts with them. The rest of the budget holds the pipeline: the partition
    stepping, the ones being read ahead and the ones being written behind.
    """
    if sum(p.working_set for p in partitions) <= budget:
        return set()
    kept, evicted = 0, set()
    for part in partitions:
        if not evicted and kept + part.working_set <= budget // 3:
            kept += part.working_set
        else:
            evicted.add(part.index)
    return evicted


def _check_class(optimizer_class: Any) -> None:
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


def _probe(
    inner: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype
) -> tuple[int, ...]:
    try:
        return probe_state_itemsizes(type(inner), group, dtype)
    except Exception as exc:
        raise ConfigError(
            f"cannot size the state of {type(inner).__name__} for {dtype} parameters: {exc}"
        ) from exc


def _compute_device(tier: str) -> torch.device:
    if tier == "device" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _master_copy(slot: Slot, device: torch.device) -> torch.Tensor:
    return slot.local.detach().to(device=device, dtype=master_dtype(slot.param), copy=True)
