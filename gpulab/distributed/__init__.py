"""More than one process, one concern per module (as picotron keeps them):

- ``launch``: ``torchrun(script, nproc=2)`` starts a script written with ``%%writefile`` under torchrun, shows each
  rank's output as it comes, stops every process it started at a time limit (or when the cell is interrupted) and
  says which rank failed and why, instead of hanging;
- ``work``: ``rank_counts`` says how many ranks a lesson runs, ``WorkSize`` how much work each gets (lesson 07's plan
  chooses it, ``gpulab.plans.plan07``); ``interleaved`` times configurations in short blocks, in alternating order
  (A B B A ...), inside a launched script: its pairs go to ``gpulab.Comparison.of``;
- ``rank``: what the launched scripts use inside each rank (the plan's sizes from the command line, rank 0's rows,
  ``timed`` blocks all ranks start together, DDP's all-reduces counted, the bytes a rank holds);
- ``collectives``: ``bus_bandwidth`` follows nccl-tests' conventions; ``fit_link`` reads a link's latency and
  bandwidth off measured all-reduce times; the links and topologies the model knows;
- ``scaling``: ``ddp_step_seconds`` and ``scaling_table``, the scaling model. Its lines are estimates;
- ``figures``: the lesson's figures (import it: ``from gpulab.distributed import figures``).

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
from .launch import RESULT, BadResult, LaunchFailed, Run, child_stderr, free_port, record, scratch_dir, torchrun
from .scaling import ddp_step_seconds, scaling_table
from .work import WorkSize, interleaved, rank_counts

__all__ = ["BUS_FACTORS", "INFINIBAND_NDR", "NVLINK4", "PCIE4", "RESULT", "TOPOLOGIES", "VENDOR_LINKS", "BadResult",
           "LaunchFailed", "Link", "Run", "Topology", "WorkSize", "bus_bandwidth", "child_stderr", "ddp_step_seconds",
           "fit_link", "free_port", "interleaved", "rank_counts", "record", "ring_allreduce_seconds", "scaling_table",
           "scratch_dir", "torchrun"]
