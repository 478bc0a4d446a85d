"""The module hooks of a :class:`~tierswap.optim.stream.ParameterStream`: forward, the
outputs' gradients (backward reaching a module), ``load_state_dict`` and the model's
``state_dict``. Each holds the stream weakly, so a dropped optimizer leaves nothing behind in
the model.

Private to :mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tierswap.optim.stream._stream import ParameterStream

__all__ = ["hook_modules"]


def hook_modules(
    stream: ParameterStream, modules: list[torch.nn.Module], model: torch.nn.Module | None
) -> list[Any]:
    """Hook ``modules`` (module ``position`` of the stream is ``modules[position]``) and
    ``model``'s state dict to ``stream``; the handles."""
    ref = weakref.ref(stream)
    handles = []
    for position, module in enumerate(modules):
        handles += [
            module.register_forward_pre_hook(functools.partial(_before, ref, position)),
            module.register_forward_hook(
                functools.partial(_after, ref, position), always_call=True
            ),
            module.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                functools.partial(_before_load, ref, position)
            ),
            module.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
                functools.partial(_after_load, ref, position)
            ),
        ]
    if model is not None:
        handles.append(
            model.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
                functools.partial(_filled_state_dict, ref)
            )
        )
    return handles


def before_backward(ref: weakref.ref[ParameterStream], position: int, grad: Any) -> None:
    """A hook on an output of module ``position``: backward has reached it."""
    stream = ref()
    if stream is not None:
        stream.before_backward(position)


def _before(ref: weakref.ref[ParameterStream], position: int, module: Any, args: Any) -> None:
    stream = ref()
    if stream is not None:
        stream.before_forward(position)


def _after(
    ref: weakref.ref[ParameterStream], position: int, module: Any, args: Any, output: Any
) -> None:
    stream = ref()
    if stream is not None:
        stream.after_forward(position, output)


def _before_load(ref: weakref.ref[ParameterStream], position: int, *args: Any) -> None:
    stream = ref()
    if stream is not None:
        stream.before_load(position)


def _after_load(ref: weakref.ref[ParameterStream], position: int, *args: Any) -> None:
    stream = ref()
    if stream is not None:
        stream.after_load(position)


def _filled_state_dict(
    ref: weakref.ref[ParameterStream],
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    """``model.state_dict()``: the streamed parameters' entries as CPU copies of their values."""
    stream = ref()
    if stream is None:
        return
    for name, index in stream.names_of(module).items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = stream.read_values(index)
