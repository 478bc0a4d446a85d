"""What a streamed parameter is while the optimizer streams it: a :class:`StreamedParameter`.

Between uses a streamed parameter holds no memory (its storage is resized to zero bytes), and
its module's hooks give it values before the module runs. A parameter used where no hook of
its own module runs would reach a kernel with a null data pointer: an error in some kernels, a
segmentation fault in others. That happens in ordinary models: ``nn.MultiheadAttention`` hands
``self.out_proj.weight`` to its functional form (the ``out_proj`` module never runs), a tied
head written as ``F.linear(h, self.wte.weight)``, a weight penalty in the training loop.

So the optimizer turns each streamed ``torch.nn.Parameter`` into this subclass (the same
object: ``__class__`` changes, nothing else) until it closes. Its ``__torch_function__`` sees
every torch operation on the parameter. An operation that reads its values (anything but
metadata: shape, dtype, ``.grad``, storage, hooks, ``detach`` ...) tells the stream first
(:meth:`~tierswap.optim.stream.ParameterStream.use`) when the parameter holds no values, or
when autograd may save it for backward (gradients enabled, the parameter trainable): the
stream gives it its values and keeps them while a use may need them. Values lent for one
operation only are let go after it (:meth:`~tierswap.optim.stream.ParameterStream.used`),
unless its result is a view of them. The optimizer's own work on parameters that hold values
runs without gradients, so it is not seen. The operation itself runs as on a plain
parameter: its results are plain tensors.

``detach()`` and ``.data`` read nothing: ``model.state_dict()`` detaches every parameter
before the optimizer's hook puts their values in, and must not read them all. What they
return is a :class:`StreamedAlias`, guarded as the parameter is.

An operation that writes into a parameter's values outside the optimizer (an init, a clamp,
an average copied back) moves its version counter (or, through ``.data``, the alias's, which
the guard reports): the stream keeps such values as the masters before it frees them or a
step reads the masters (:meth:`~tierswap.optim.stream.ParameterStream.edited`).

A copy of a streamed parameter (``copy.deepcopy``, pickling, ``torch.save``: of the model, for
an EMA or ``torch.optim.swa_utils.AveragedModel``, or of the parameter) is a plain
``torch.nn.Parameter`` holding the values, read from the swap space without giving the
streamed one memory; torch's own copy would read its empty storage and crash.

Private to :mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import torch
from torch.utils._pytree import tree_leaves

from tierswap.errors import ConfigError, StoreClosedError

__all__ = ["Guarded", "StreamedAlias", "StreamedParameter", "guard", "not_traced", "unguard"]

_F = TypeVar("_F", bound=Callable[..., Any])


def not_traced(fn: _F) -> _F:
    """``fn``, which dynamo must not trace (``torch.compile`` recursed through the guard until
    the stack ran out): ``torch.compiler.disable(fn)`` once dynamo is loaded, as
    ``torch.compile`` loads it, and ``fn`` itself before (loading dynamo at import would cost
    every run 2 s and 70 MB)."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
        return disabled(*args, **kwargs)

    return inner  # type: ignore[return-value]


#: Tensor methods and properties that do not read a parameter's values.
_METADATA = frozenset(
    {
        "data", "dim", "element_size", "get_device", "is_complex", "is_contiguous",
        "is_floating_point", "is_pinned", "numel", "register_hook",
        "register_post_accumulate_grad_hook", "requires_grad_", "size", "storage_offset",
        "stride", "untyped_storage", "data_ptr", "__repr__", "detach",
    }
)  # fmt: skip
#: Properties that return a view of the values (the others are metadata).
_VIEWS = frozenset({"T", "mT", "H", "mH", "real", "imag"})


class ValueUser(Protocol):
    """Who streams the parameter (:class:`~tierswap.optim.stream.ParameterStream`)."""

    def use(self, index: int, *, saved: bool) -> bool:
        """The parameter of slot ``index`` is about to be read (``saved``: autograd may save
        it for backward): give it its values; whether they are lent for this operation only
        (:meth:`used` then follows)."""
        ...

    def used(self, index: int, *, viewed: bool) -> None:
        """The operation that values were lent for ran; ``viewed``: its result views them."""
        ...

    def read_values(self, index: int) -> torch.Tensor:
        """A CPU copy of the values of slot ``index``'s parameter (it gets no memory)."""
        ...

    def edited(self, index: int) -> None:
        """An operation wrote into slot ``index``'s parameter's values through an alias."""
        ...


class Guarded(torch.Tensor):
    """A tensor whose values the stream of ``_tierswap_stream`` (slot ``_tierswap_slot``)
    gives it before any operation reads them: a :class:`StreamedParameter`, or a
    :class:`StreamedAlias` of one."""

    _tierswap_stream: weakref.ref[ValueUser]
    _tierswap_slot: int

    @classmethod
    @not_traced
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if not _reads_values(func):
                if _property(func) == ("data", "__set__") and isinstance(args[0], Guarded):
                    return _set_data(args[0], args[1])
                result = func(*args, **kwargs)
                if _aliases(func) and isinstance(args[0], Guarded):
                    return _alias(result, args[0])
                return result
            guarded: list[Guarded] = []
            _find_guarded(args, guarded)
            _find_guarded(kwargs.values(), guarded)
            versions = [t._version for t in guarded]
            lent: list[tuple[Guarded, ValueUser]] = []
            viewed: list[bool] = []
            try:
                for leaf in guarded:
                    saved = torch.is_grad_enabled() and leaf.requires_grad
                    stream = leaf._stream() if saved or _empty(leaf) else None
                    if stream is not None and stream.use(leaf._tierswap_slot, saved=saved):
                        lent.append((leaf, stream))
                result = func(*args, **kwargs)
                viewed = [_views(result, tensor) for tensor, _ in lent]
                return result
            finally:
                _report_edits(guarded, versions)
                for (tensor, stream), view in zip(lent, viewed or [False] * len(lent), strict=True):
                    stream.used(tensor._tierswap_slot, viewed=view)

    def _stream(self) -> ValueUser | None:
        """Who streams this parameter; ``StoreClosedError`` if it holds no values and the
        optimizer is gone without ``close()`` (which gives every parameter its values back)."""
        stream = self._tierswap_stream()
        if stream is None and _empty(self):
            raise StoreClosedError(
                f"this parameter (shape {tuple(self.shape)}) was streamed by a SwapOptimizer "
                "that was dropped without close(): its values are in that optimizer's swap "
                "folder (a new SwapOptimizer on it resumes them)"
            )
        return stream

    def _values(self) -> torch.Tensor:
        """A copy of the values, on this tensor's device, read without giving it memory."""
        stream = self._stream()
        with torch._C.DisableTorchFunctionSubclass():
            if stream is None:  # it holds its values
                return self.detach().clone()
            return stream.read_values(self._tierswap_slot).to(self.device)

    def _copy(self, values: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The plain tensor a copy of this one is, holding ``values`` (attributes ``state``)."""
        return values

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) not in memo:
            memo[id(self)] = self._copy(self._values(), {})
            memo[id(self)].__dict__.update(copy.deepcopy(_own_state(self), memo))
        return memo[id(self)]  # type: ignore[no-any-return]

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickled (``torch.save``) as the plain tensor it was: loading needs no tierswap."""
        plain = self._copy(self._values(), _own_state(self))
        return plain.__reduce_ex__(proto)  # type: ignore[no-untyped-call]


class StreamedParameter(Guarded, torch.nn.Parameter):
    """A ``torch.nn.Parameter`` streamed by the optimizer (:func:`guard`); a subclass of
    ``Parameter`` gets a class of its own, made by :func:`_streamed_class`."""

    #: The class the parameter had, and gets back when the optimizer closes.
    _tierswap_plain: type[torch.nn.Parameter] = torch.nn.Parameter

    def _copy(self, values: torch.Tensor, state: dict[str, Any]) -> torch.nn.Parameter:
        param = self._tierswap_plain(values, self.requires_grad)  # as torch's deepcopy calls it
        param.__dict__.update(state)
        return param

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        if _empty(self):
            return (
                f"StreamedParameter(shape={tuple(self.shape)}, dtype={self.dtype}, "
                "values in the swap space between uses)"
            )
        return str(super().__repr__(*args, **kwargs))  # type: ignore[no-untyped-call]


class StreamedAlias(Guarded):
    """What ``detach()`` or ``.data`` of a :class:`StreamedParameter` returns: an alias of
    its memory, so it holds values exactly when the parameter does, and reads them as the
    parameter does (``torch.optim.swa_utils.AveragedModel`` reads ``p.detach()`` of each
    parameter; older code clamps or fills ``p.data``)."""


def _find_guarded(values: Iterable[Any], found: list[Guarded]) -> None:
    """Append the guarded tensors among ``values`` (nested in tuples, lists and dicts, as a
    torch function's arguments are) to ``found`` (pytree's general walk costs more than the
    operation on small layers)."""
    for value in values:
        if isinstance(value, Guarded):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            _find_guarded(value, found)
        elif isinstance(value, dict):
            _find_guarded(value.values(), found)


def _aliases(func: Any) -> bool:
    """Whether ``func`` (a metadata function) returns an alias of the values: ``detach()``,
    or the getter of ``.data``."""
    return getattr(func, "__name__", "") == "detach" or _property(func) == ("data", "__get__")


def _property(func: Any) -> tuple[str, str] | None:
    """The property and ``"__get__"`` or ``"__set__"``, when ``func`` is a property's."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(func.__self__, "__name__", ""), name
    return None


def _set_data(tensor: Guarded, value: Any) -> None:
    """``tensor.data = value`` (``torch.nn.utils.vector_to_parameters``, ``module.to()``):
    the values are copied in, since a streamed parameter's memory is its own (the stream
    frees and refills it: taking ``value``'s would free the caller's); a change of shape,
    dtype or device raises ``ConfigError``, and the stored values stay as they were."""
    if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
        tensor.shape, tensor.dtype, tensor.device
    ):  # fmt: skip
        what = (
            (value.shape, value.dtype, value.device) if isinstance(value, torch.Tensor) else value
        )
        raise ConfigError(
            f"a streamed parameter ({tuple(tensor.shape)}, {tensor.dtype}, {tensor.device}) "
            f"cannot take .data of another shape, dtype or device {what}: move or cast the "
            "model before the SwapOptimizer takes it, or after its close()"
        )
    if isinstance(value, Guarded) and (value._tierswap_stream(), value._tierswap_slot) == (
        tensor._tierswap_stream(), tensor._tierswap_slot
    ):  # fmt: skip
        return  # its own values (``p.data = p.data``)
    with torch.no_grad():  # through the guard: values lent, the edit reported
        Guarded.__torch_function__(torch.Tensor.copy_, (), (tensor, value))


def _report_edits(guarded: list[Guarded], versions: list[int]) -> None:
    """Tell the stream of each of ``guarded`` whose version moved from ``versions`` (an
    in-place operation wrote into it) about the edit: an alias through ``.data`` has a
    version counter of its own, which the stream does not see."""
    for tensor, version in zip(guarded, versions, strict=True):
        if tensor._version != version and (stream := tensor._tierswap_stream()) is not None:
            stream.edited(tensor._tierswap_slot)


def _alias(tensor: torch.Tensor, of: Guarded) -> StreamedAlias:
    """``tensor`` (a detached alias of ``of``) as a :class:`StreamedAlias`."""
    alias = tensor.as_subclass(StreamedAlias)
    alias._tierswap_stream, alias._tierswap_slot = of._tierswap_stream, of._tierswap_slot
    return alias


def _reads_values(func: Any) -> bool:
    """Whether ``func`` (a torch function, method, or a property's getter or setter) may read
    the values of the tensors it is given."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: metadata, except the views
        return getattr(func.__self__, "__name__", "") in _VIEWS
    return name not in _METADATA


def _empty(param: torch.Tensor) -> bool:
    """Whether ``param`` holds no values now (freed between uses; an empty one has none to
    hold)."""
    return param.untyped_storage().nbytes() == 0 and param.numel() > 0


def _own_state(param: torch.Tensor) -> dict[str, Any]:
    """``param``'s attributes, less the guard's own."""
    return {k: v for k, v in param.__dict__.items() if not k.startswith("_tierswap_")}


def _views(result: Any, tensor: torch.Tensor) -> bool:
    """Whether a tensor of ``result`` shares ``tensor``'s memory, unguarded (a guarded one,
    ``tensor`` itself among them, reads the values again when it needs them)."""
    memory = tensor.untyped_storage().data_ptr()
    return any(
        isinstance(t, torch.Tensor)
        and not isinstance(t, Guarded)
        and t.untyped_storage().data_ptr() == memory
        for t in tree_leaves(result)
    )


def guard(param: torch.Tensor, stream: ValueUser, index: int) -> bool:
    """Make ``param`` a :class:`StreamedParameter` of slot ``index`` of ``stream``: a
    ``torch.nn.Parameter``, or a subclass of it that leaves ``__torch_function__`` to torch
    (one with its own stays as it is: two guards cannot both see its operations); whether it
    is guarded now."""
    cls = type(param)
    if isinstance(param, torch.nn.Parameter) and not isinstance(param, StreamedParameter):
        if cls.__torch_function__ is not torch.nn.Parameter.__torch_function__:
            return False
        try:
            param.__class__ = _streamed_class(cls)
        except TypeError:  # a layout of its own (__slots__): it stays as it is
            return False
    if isinstance(param, StreamedParameter):
        param._tierswap_stream = weakref.ref(stream)
        param._tierswap_slot = index
        return True
    return False


def warn_unguarded(names: list[str]) -> None:
    """Warn that the streamed parameters ``names`` could not be guarded (:func:`guard`): a
    use of one outside its module's forward would read memory it does not hold."""
    if names:
        shown = ", ".join(repr(name) for name in names[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        warnings.warn(
            f"streamed parameters {shown}{more} are of a Parameter subclass with its own "
            "__torch_function__ (or __slots__): tierswap reads their values for their own "
            "modules' forward and backward, but cannot see other uses of them, which would "
            "read memory they do not hold (a crash); use them only inside their modules",
            UserWarning,
            stacklevel=_callers_level(),
        )


#: The package's folder: frames in it are tierswap's own, not its caller's.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside tierswap, for a warning raised by the
    function that calls this one (the optimizer's construction, ``add_param_group``)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


@functools.cache
def _streamed_class(cls: type[torch.nn.Parameter]) -> type[StreamedParameter]:
    """The :class:`StreamedParameter` class of parameters of class ``cls``."""
    if cls is torch.nn.Parameter:
        return StreamedParameter
    name = f"Streamed{cls.__name__}"
    return type(name, (StreamedParameter, cls), {"_tierswap_plain": cls})


def unguard(param: torch.Tensor) -> None:
    """Give ``param`` its class back."""
    if isinstance(param, StreamedParameter):
        param.__class__ = type(param)._tierswap_plain  # type: ignore[assignment]
        del param._tierswap_stream, param._tierswap_slot
