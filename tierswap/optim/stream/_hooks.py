"""The module hooks of a :class:`~tierswap.optim.stream.ParameterStream`: which modules it
hooks (the model and the owners of streamed parameters), and the hooks: forward, the outputs'
gradients (backward reaching a module), ``load_state_dict`` and the model's ``state_dict``.
Each holds the stream weakly, so a dropped optimizer leaves nothing behind in the model. A
copy of the model (``copy.deepcopy``, pickling, ``torch.save``) carries copies of the hooks
that do nothing: the copy's parameters are plain ones that hold their values.

Private to :mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tierswap.errors import ConfigError
from tierswap.optim.plan import Slot
from tierswap.optim.stream._guard import not_traced

if TYPE_CHECKING:
    from tierswap.optim.stream._stream import ParameterStream

__all__ = ["check_owned", "hook_modules", "owners"]


def hook_modules(
    stream: ParameterStream, modules: list[torch.nn.Module], model: torch.nn.Module | None
) -> list[Any]:
    """Hook ``modules`` (module ``position`` of the stream is ``modules[position]``) and
    ``model``'s state dict to ``stream``; the handles."""
    ref = weakref.ref(stream)
    handles = []
    for position, module in enumerate(modules):
        handles += [
            module.register_forward_pre_hook(_Hook(ref, _before, position)),
            module.register_forward_hook(_Hook(ref, _after, position), always_call=True),
            module.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                _Hook(ref, _before_load, position)
            ),
            module.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
                _Hook(ref, _after_load, position)
            ),
        ]
    if model is not None:
        handles.append(
            model.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
                _Hook(ref, _filled_state_dict)
            )
        )
    return handles


class _Hook:
    """A module hook: ``event(stream, *args, *hook_args)`` while the stream lives. A copy
    (``copy.deepcopy``, pickling) has no stream: it does nothing."""

    def __init__(self, ref: Callable[[], ParameterStream | None], event: Any, *args: Any) -> None:
        self._ref, self._event, self._args = ref, event, args

    @not_traced  # reads, threads
    def __call__(self, *hook_args: Any) -> None:
        stream = self._ref()
        if stream is not None:
            self._event(stream, *self._args, *hook_args)

    def __reduce__(self) -> tuple[Any, ...]:
        return _Hook, (_no_stream, _before)


def _no_stream() -> None:
    """The stream of a copied hook: none."""


def before_backward(ref: weakref.ref[ParameterStream], position: int, grad: Any) -> None:
    """A hook on an output of module ``position``: backward has reached it."""
    stream = ref()
    if stream is not None:
        stream.before_backward(position)


def _before(stream: ParameterStream, position: int, module: Any, args: Any) -> None:
    stream.before_forward(position)


def _after(stream: ParameterStream, position: int, module: Any, args: Any, output: Any) -> None:
    stream.after_forward(position, output)


def _before_load(stream: ParameterStream, position: int, *args: Any) -> None:
    stream.before_load(position)


def _after_load(stream: ParameterStream, position: int, *args: Any) -> None:
    stream.after_load(position)


def _filled_state_dict(
    stream: ParameterStream,
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    """``model.state_dict()``: the streamed parameters' entries as CPU copies of their values."""
    for name, index in stream.names_of(module).items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = stream.read_values(index)


def owners(
    model: torch.nn.Module, slot_of: dict[int, Slot]
) -> list[tuple[torch.nn.Module, list[int]]]:
    """``model`` and each module of it that owns streamed parameters, with their slot
    indices."""
    owners = []
    for module in model.modules():
        owned = [
            slot_of[id(p)].index
            for p in module.parameters(recurse=False)
            if id(p) in slot_of and slot_of[id(p)].streamed
        ]
        if owned or module is model:
            owners.append((module, owned))
    return owners


def check_owned(model: torch.nn.Module, slots: list[Slot]) -> None:
    """Raise ``ConfigError`` unless every parameter the optimizer streams is ``model``'s (its
    modules' hooks are what read a streamed parameter)."""
    owned = {id(param) for param in model.parameters()}
    strays = [slot.name or slot.prefix for slot in slots if id(slot.param) not in owned]
    if strays:
        raise ConfigError(
            f"parameters {strays[:4]} (of {len(strays)}) are not parameters of the model; "
            "with offload_parameters=True every parameter must be one (its module reads it)"
        )
