"""Parameter streaming (``offload_parameters=True``): the model's parameters hold memory only
while their modules run, and the swap space keeps their values.

- ``_stream``: :class:`ParameterStream`, the module hooks and the reads through the
  optimizer's pipeline;
- ``_storage``: freeing and refilling a parameter's memory in place;
- ``_placeholder``: :class:`OffloadedGradient`, what ``param.grad`` holds while the gradient
  lives in the swap space.
"""

from __future__ import annotations

from tierswap.optim.stream._placeholder import OffloadedGradient
from tierswap.optim.stream._stream import ParameterStream

__all__ = ["OffloadedGradient", "ParameterStream"]
