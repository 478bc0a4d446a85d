"""Models built on the meta device: their parameters get their first values in the swap space.

A model too large for memory is built under ``torch.device("meta")``: shapes and dtypes, no
values. :func:`place` gives each meta parameter a real device and no memory, the state a
streamed parameter has between uses, and keeps the parameter object (the model's modules, the
optimizer's param groups and tied weights all still name it). :func:`initialize` then runs an
init function over the modules and writes each parameter's first master to the store:

- The init function is called once per module, children before parents, as
  ``Module.apply`` calls it. By default a module that owns meta parameters or buffers gets
  ``module.reset_parameters()`` (what torch's layers call when they are built in memory), so a
  model of torch layers starts from the values the same seed gives it in memory.
- A parameter holds memory only while one call uses it. The first torch operation that takes
  the parameter as an argument (``init.normal_``, ``.data``, ``copy_``) brings it in: zeros the
  first time, its stored master after that (an init of a parent module that rescales a child's
  weight, as GPT-2's does). When the call returns, every parameter it brought in is written and
  freed. Memory holds what one module's init uses, whatever the model's size.
- A parameter no call touched has no value: that is an error, never a silent zero.

Meta buffers are not streamed: each gets zeroed memory of its own on the device before the init
function runs, which is expected to set the ones that need values. A resumed run takes its
parameters from the store, and runs the init only for the modules that own meta buffers (their
parameters are read for it, and not written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tierswap.errors import ConfigError
from tierswap.optim.persist import OptimizerParts, read_master, write_master
from tierswap.optim.stream._storage import allocate, free, to_placed

__all__ = ["Placed", "has_meta", "initialize", "place", "place_model"]

InitFn = Callable[[torch.nn.Module], None]

#: Tensor methods and attributes that read no values: they do not bring a parameter in.
_METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "ndim")]
    + [getattr(torch.Tensor, name).__get__ for name in ("requires_grad", "is_meta", "layout")]
    + [torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.is_floating_point]
)


def has_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a parameter or buffer on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    return any(tensor.is_meta for tensor in tensors)


@dataclasses.dataclass
class Placed:
    """What :func:`place` gave a device: the meta parameters (each once) and the modules
    that own meta buffers."""

    params: list[torch.nn.Parameter]
    buffer_owners: list[torch.nn.Module]


def place_model(model: torch.nn.Module, *, offload: bool) -> Placed:
    """:func:`place` ``model``'s meta parameters, if it has any, on
    ``torch.get_default_device()`` (the CPU where that is the meta device); ``offload``:
    whether the optimizer streams them (``offload_parameters``), else a meta model is refused."""
    if not has_meta(model):
        return Placed([], [])
    if not offload:
        raise ConfigError(
            "the model was built on the meta device (its parameters have no values): "
            "SwapOptimizer(model, ..., offload_parameters=True) gives them their first values "
            "in the swap space; without it, build the model in memory"
        )
    device = torch.get_default_device()
    return place(model, torch.device("cpu") if device.type == "meta" else device)


def place(model: torch.nn.Module, device: torch.device) -> Placed:
    """Give each meta parameter of ``model`` the ``device`` and no memory, in place (the same
    Python object, its attributes kept), and each meta buffer zeroed memory on ``device``."""
    params: dict[int, torch.nn.Parameter] = {}
    owners: list[torch.nn.Module] = []
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta and id(param) not in params:
                _swap_in_empty(param, device, f"{module_name}.{name}".lstrip("."))
                params[id(param)] = param
        buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if b.is_meta]
        for name, buffer in buffers:
            setattr(module, name, torch.zeros_like(buffer, device=device))
        if buffers:
            owners.append(module)
    return Placed(list(params.values()), owners)


def _swap_in_empty(param: torch.nn.Parameter, device: torch.device, name: str) -> None:
    if type(param) is not torch.nn.Parameter:
        raise ConfigError(
            f"parameter {name!r} is a {type(param).__name__} on the meta device; tierswap "
            "places plain torch.nn.Parameter objects only"
        )
    to_placed(param, device)


def initialize(
    parts: OptimizerParts,
    model: torch.nn.Module,
    placed: Placed,
    init_fn: InitFn | None,
    *,
    resumed: bool = False,
) -> None:
    """Run ``init_fn`` (default: ``reset_parameters``) over ``model``'s modules, children
    first, and write the first master of each parameter ``placed`` to ``parts``' store;
    raises ``ConfigError`` before anything runs if a module would need ``reset_parameters``
    and lacks it, and after, if a parameter was never given a value.

    ``resumed``: the store holds the parameters already. Only the modules that own meta
    buffers are initialized, for their buffers; the parameters they use are read from the
    store and written nowhere."""
    slot_of = parts.layout.slot_of
    pending = {id(param): param for param in placed.params}
    written: set[int] = set(pending) if resumed else set()
    if resumed:
        calls = [(init_fn or _reset, module) for module in placed.buffer_owners]
    else:
        calls = list(_calls(model, pending, placed.buffer_owners, init_fn))
    for fn, module in calls:
        with _BringIn(pending, written, parts) as used:
            fn(module)
        for param in used.live:
            if not resumed:
                write_master(parts, slot_of[id(param)])
            free(param)
            written.add(id(param))
    if any(id(p) not in slot_of for p in model.parameters()):
        raise ConfigError(
            "the init function replaced parameters of the model (module.weight = "
            "nn.Parameter(...)); it must set their values in place (torch.nn.init, copy_)"
        )
    missing = [name for name, p in model.named_parameters() if id(p) in pending.keys() - written]
    if missing:
        raise ConfigError(
            f"parameters {missing[:4]} (of {len(missing)}) were built on the meta device and "
            "no init function gave them values; pass param_init_fn, a function of a module "
            "that sets its parameters (for a Hugging Face model: param_init_fn=model._init_weights)"
        )


def _calls(
    model: torch.nn.Module,
    pending: dict[int, torch.nn.Parameter],
    buffer_owners: list[torch.nn.Module],
    init_fn: InitFn | None,
) -> Iterator[tuple[InitFn, torch.nn.Module]]:
    """The (function, module) calls that initialize ``model``, children before parents."""
    if init_fn is not None:
        for module in _post_order(model):
            yield init_fn, module
        return
    owners = {id(module) for module in buffer_owners}

    def owns_meta(module: torch.nn.Module) -> bool:
        params = module.parameters(recurse=False)
        return id(module) in owners or any(id(p) in pending for p in params)

    lacking = [
        f"{name or 'the model'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if owns_meta(module) and not callable(getattr(module, "reset_parameters", None))
    ]
    if lacking:
        raise ConfigError(
            f"modules {lacking[:4]} (of {len(lacking)}) hold parameters or buffers on the meta "
            "device and have no reset_parameters(); pass param_init_fn, a function of a module "
            "that sets them (for a Hugging Face model: param_init_fn=model._init_weights)"
        )
    for module in _post_order(model):
        if owns_meta(module):
            yield _reset, module


def _reset(module: torch.nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` and its submodules, each once, children before parents (as ``apply``)."""
    seen: set[int] = set()

    def walk(node: torch.nn.Module) -> Iterator[torch.nn.Module]:
        if id(node) in seen:
            return
        seen.add(id(node))
        for child in node.children():
            yield from walk(child)
        yield node

    yield from walk(module)


class _BringIn(TorchFunctionMode):
    """While active, the first torch operation that takes one of ``pending``'s parameters
    gives it memory: its stored master if it is in ``written``, else zeros. ``live`` lists
    them, in that order."""

    def __init__(
        self,
        pending: dict[int, torch.nn.Parameter],
        written: set[int],
        parts: OptimizerParts,
    ) -> None:
        super().__init__()
        self.pending = pending
        self.written = written
        self.parts = parts
        self.live: list[torch.nn.Parameter] = []
        self._live_ids: set[int] = set()

    def __enter__(self) -> _BringIn:
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            for leaf in tree_leaves((args, kwargs)):
                if id(leaf) in self.pending and id(leaf) not in self._live_ids:
                    self._bring(self.pending[id(leaf)])
        return func(*args, **kwargs)

    def _bring(self, param: torch.nn.Parameter) -> None:
        values = allocate(param)
        with torch.no_grad():
            if id(param) in self.written:
                slot = self.parts.layout.slot_of[id(param)]
                values.copy_(read_master(self.parts, slot))
            else:
                values.zero_()
        self.live.append(param)
        self._live_ids.add(id(param))
