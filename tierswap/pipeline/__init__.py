"""The streaming pipeline: read ahead, work, write behind, within one byte budget.

:class:`Pipeline` schedules a cyclic workload of :class:`Job` s (each naming the :class:`Region` s
of stored tensors it needs) through the three stages; its module says how. The jobs are in
``_jobs``, the jobs' host buffers in ``_buffers``; the reads, write-behinds, regions and store
protocol are the engine's (:class:`~tierswap.engine.Disk`).
"""

from tierswap.engine import Region, StoreProtocol
from tierswap.pipeline._jobs import Job, Work
from tierswap.pipeline._pipeline import Pipeline

#: What a pipeline needs from its store: the engine's store protocol.
RegionStore = StoreProtocol

__all__ = ["Job", "Pipeline", "Region", "RegionStore", "Work"]
