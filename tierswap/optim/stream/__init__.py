"""Parameter streaming (``offload_parameters=True``): the model's parameters hold memory only
while their modules run, and the swap space keeps their values.

- ``_stream``: :class:`ParameterStream`, what the hooks' events do: which parameters hold
  values when, read ahead in the recorded order of uses;
- ``_order``: :class:`~tierswap.optim.stream._order.UseOrder`, the order in which modules use
  their parameters, recorded once: what to read ahead, which parameters to keep (Belady);
- ``_gradients``: :class:`~tierswap.optim.stream._gradients.KeptGradients`, the gradients
  kept in the swap space from backward to the step, and what clipping and unscaling ask of
  them;
- ``_swap``: where a parameter's values and kept gradient are in the swap space, and the
  moves between there and memory (copies from resident slices, the pipeline's reads and
  write-behinds);
- ``_into_forward``: the step that runs into the next forward (``overlap="forward"``), as
  the stream sees it: whose thread its calls into the pipeline go through meanwhile;
- ``_hooks``: the module hooks, which hold the stream weakly;
- ``_guard``: :class:`~tierswap.optim.stream._guard.StreamedParameter`, what a streamed
  parameter is meanwhile: it asks the stream for its values where no hook of its module runs,
  and its copies (``copy.deepcopy``, pickling) are plain parameters with its values;
- ``_storage``: freeing and refilling a parameter's memory in place;
- ``_placeholder``: :class:`OffloadedGradient`, what ``param.grad`` holds while the gradient
  lives in the swap space;
- ``_meta``: a model built on the meta device: placing its parameters and writing their first
  values, one module's init at a time.
"""

from __future__ import annotations

from tierswap.optim.stream._hooks import check_owned
from tierswap.optim.stream._meta import Placed, has_meta, initialize, place, place_model
from tierswap.optim.stream._placeholder import OffloadedGradient
from tierswap.optim.stream._storage import idle_room, to_meta
from tierswap.optim.stream._stream import ParameterStream

__all__ = [
    "OffloadedGradient",
    "ParameterStream",
    "Placed",
    "check_owned",
    "has_meta",
    "idle_room",
    "initialize",
    "place",
    "place_model",
    "to_meta",
]
