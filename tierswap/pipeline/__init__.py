"""The streaming pipeline: read ahead, work, write behind, within one byte budget.

:class:`Pipeline` (its module says how) runs a cyclic workload of :class:`Job` s, each naming the
:class:`Region` s of stored tensors it needs, over the engine's
:class:`~tierswap.engine.Disk` and store protocol."""

from tierswap.engine import Region
from tierswap.pipeline._behind import Ended
from tierswap.pipeline._jobs import Job, Work
from tierswap.pipeline._pipeline import Pipeline

__all__ = ["Ended", "Job", "Pipeline", "Region", "Work"]
