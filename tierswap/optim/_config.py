"""Settings of a SwapOptimizer, validated once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from tierswap.config import Size, parse_size
from tierswap.engine.policies import EvictionPolicy
from tierswap.errors import ConfigError
from tierswap.optim.formats import MasterFormat, StatePrecision, check_master, check_precision

__all__ = ["SwapConfig"]

_OVERLAPS = ("auto", None, "backward", "forward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """Where and how a :class:`~tierswap.SwapOptimizer` keeps its state (built by keyword).

    The fields are the keywords of :class:`~tierswap.SwapOptimizer`, in the same order and with
    the same defaults (``tests/optim/test_adapters.py`` holds them together).

    ``host_budget=None`` sizes the host tier to the whole state (everything stays in RAM);
    ``device_budget=0`` turns the device tier off. ``commit_every="auto"`` commits so that
    commits take about a tenth of the training time
    (:mod:`tierswap.optim.persist._commit_clock`), ``N`` every N steps, ``0`` only on
    ``commit()`` and at ``close()``. ``state_precision`` and
    ``master`` choose the compact formats of :mod:`tierswap.optim.formats` (``"fp32"``:
    exact, the default). ``offload_parameters`` streams the parameters too
    (:mod:`tierswap.optim.stream`); ``param_init_fn`` initializes those of a model built on
    the meta device (:mod:`tierswap.optim.stream._meta`); ``model`` names the model whose
    parameters stream when the optimizer is given param groups.
    """

    swap_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None
    host_budget: Size | None = None
    device_budget: Size = 0
    policy: str | EvictionPolicy = "lookahead"
    durable: bool = True
    commit_every: int | Literal["auto"] = "auto"
    resume: bool = False
    overlap: str | None = "auto"
    accumulation_steps: int = 1
    resume_from: str | os.PathLike[str] | None = None
    state_precision: StatePrecision = "fp32"
    master: MasterFormat = "fp32"
    offload_parameters: bool = False
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    model: torch.nn.Module | None = None

    def __post_init__(self) -> None:
        if self.host_budget is not None:
            object.__setattr__(
                self, "host_budget", parse_size(self.host_budget, name="host_budget")
            )
        object.__setattr__(
            self, "device_budget", parse_size(self.device_budget, name="device_budget")
        )
        every = self.commit_every
        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ConfigError(
                f"commit_every={every!r} must be 'auto' (commits take about a tenth of the "
                "time) or an int >= 0 (every N steps; 0: only on commit() and close())"
            )
        if self.overlap not in _OVERLAPS:
            raise ConfigError(
                f"overlap={self.overlap!r} must be 'auto', None, 'backward' or 'forward'"
            )
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps={self.accumulation_steps!r} must be an int >= 1")
        check_precision(self.state_precision)
        check_master(self.master)
        self._check_offload()
        if self.resume_from is not None:
            if self.swap_dir is None:
                raise ConfigError(
                    "resume_from needs swap_dir: the folder the resumed run will swap to"
                )
            object.__setattr__(self, "resume", True)
        if self.resume and self.swap_dir is None:
            raise ConfigError("resume=True needs swap_dir: the folder of the run to resume")

    def _check_offload(self) -> None:
        """``offload_parameters`` with the schedules and formats it supports so far."""
        if not isinstance(self.offload_parameters, bool):
            raise ConfigError(f"offload_parameters={self.offload_parameters!r} must be a bool")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ConfigError(
                f"param_init_fn={self.param_init_fn!r} must be a function of a module"
            )
        if self.model is not None and not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"model={self.model!r} must be a torch.nn.Module")
        if not self.offload_parameters:
            if self.model is not None:
                raise ConfigError(
                    "model= names the modules whose hooks stream the parameters: it needs "
                    "offload_parameters=True"
                )
            if self.param_init_fn is not None:
                raise ConfigError(
                    "param_init_fn initializes a model built on the meta device, whose "
                    "parameters stream: it needs offload_parameters=True"
                )

    @classmethod
    def from_keywords(cls, **settings: Any) -> SwapConfig:
        """The config of ``settings`` (keywords of :class:`~tierswap.SwapOptimizer`); a name
        that is not a setting raises ``ConfigError`` naming it."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise ConfigError(
                f"{unknown} are not SwapOptimizer settings (those are {names}); hyper-parameters "
                "such as lr belong to the optimizer being offloaded"
            )
        return cls(**settings)

    @property
    def host_bytes(self) -> int | None:
        """``host_budget`` in bytes (``None``: the whole state)."""
        if self.host_budget is None:
            return None
        return parse_size(self.host_budget, name="host_budget")

    @property
    def device_bytes(self) -> int:
        """``device_budget`` in bytes."""
        return parse_size(self.device_budget, name="device_budget")
