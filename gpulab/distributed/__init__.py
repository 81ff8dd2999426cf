"""More than one process, one concern per module (as picotron keeps them):

- ``launch``: ``torchrun(script, nproc=2)`` starts a script written with ``%%writefile`` under torchrun, shows each
  rank's output as it comes, stops every process it started at a time limit (or when the cell is interrupted) and
  says which rank failed and why, instead of hanging;
- ``work``: ``rank_counts`` and ``work_size`` say how many ranks a lesson runs and how much work each gets (CPU-sized
  work for gloo processes on the CPU whatever GPU the machine has); ``interleaved`` times configurations in short
  blocks, in alternating order (A B B A ...), inside a launched script: its pairs go to ``gpulab.Comparison.of``;
- ``collectives``: ``bus_bandwidth`` follows nccl-tests' conventions; ``fit_link`` reads a link's latency and
  bandwidth off measured all-reduce times; the links and topologies the model knows;
- ``scaling``: ``ddp_step_seconds`` and ``scaling_table``, the scaling model. Its lines are estimates.

The lessons use them as ``gpulab.distributed.<name>``.
"""

from .collectives import (
                          BUS_FACTORS,
                          INFINIBAND_NDR,
                          NVLINK4,
                          PCIE4,
                          TOPOLOGIES,
                          VENDOR_LINKS,
                          Link,
                          Topology,
                          bus_bandwidth,
                          fit_link,
                          ring_allreduce_seconds,
)
from .launch import RESULT, BadResult, LaunchFailed, Run, child_stderr, free_port, scratch_dir, torchrun
from .scaling import ddp_step_seconds, scaling_table
from .work import CPU_WORK, GPU_WORK, QUICK_WORK, WorkSize, interleaved, rank_counts, work_size

__all__ = ["BUS_FACTORS", "CPU_WORK", "GPU_WORK", "INFINIBAND_NDR", "NVLINK4", "PCIE4", "QUICK_WORK", "RESULT",
           "TOPOLOGIES", "VENDOR_LINKS", "BadResult", "LaunchFailed", "Link", "Run", "Topology", "WorkSize",
           "bus_bandwidth", "child_stderr", "ddp_step_seconds", "fit_link", "free_port", "interleaved", "rank_counts",
           "ring_allreduce_seconds", "scaling_table", "scratch_dir", "torchrun", "work_size"]
