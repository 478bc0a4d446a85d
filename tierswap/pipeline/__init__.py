"""The streaming pipeline: read ahead, work, write behind, within one byte budget.

:class:`Pipeline` moves a cyclic workload of :class:`Job` s (each naming the :class:`Region` s
of stored tensors it needs) through the three stages; its module says how. The jobs, regions
and the store protocol are in ``_jobs``, the jobs' host buffers in ``_buffers``.
"""

from tierswap.pipeline._jobs import Job, Region, RegionStore, Work, write_regions
from tierswap.pipeline._pipeline import Pipeline

__all__ = ["Job", "Pipeline", "Region", "RegionStore", "Work", "write_regions"]
