"""How many ranks a lesson runs and how much work each gets (CPU-sized work for gloo processes on the CPU, whatever
GPU the machine has), and ``interleaved``: configurations timed in short blocks, in alternating order, inside a
launched script (its pairs go to ``gpulab.Comparison.of``).
"""

import time
from dataclasses import dataclass

import numpy as np

from ..mode import quick_mode

# ----- how many ranks, how much work, and timing inside a launched script ----------------------------


def rank_counts(gpus: int) -> list[int]:
    """The rank counts a lesson runs: 1, 2, 4, 8, ... and every GPU of the machine (3, 5, 6 or 7 too), so that
    the largest run uses the GPUs DataParallel uses; ``[1, 2]`` (gloo processes on the CPU) below two GPUs."""
    if isinstance(gpus, bool) or not isinstance(gpus, (int, np.integer)) or gpus < 0:
        raise ValueError(f"gpus is a number of GPUs, a whole number of 0 or more; got {gpus!r}")
    gpus = int(gpus)
    if gpus < 2:
        return [1, 2]
    counts = [1]
    while counts[-1] * 2 <= gpus:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == gpus else [*counts, gpus]


@dataclass(frozen=True)
class WorkSize:
    """How much work each rank of a lesson's launches does."""

    width: int  # of the WideMLP trained
    batch: int  # samples per rank and step
    rounds: int  # interleaved rounds of a timing: the pairs of each comparison
    calls: int  # steps per timed block
    max_bytes: int  # the largest collective timed
    iters: int = 100  # the most calls of a collective per timed round (the smallest messages; fewer for larger ones)

    def args(self) -> list:
        """The command-line arguments of lesson 07's DDP script for these sizes."""
        return ["--width", self.width, "--batch", self.batch, "--rounds", self.rounds, "--calls", self.calls]


CPU_WORK = WorkSize(width=512, batch=64, rounds=8, calls=2, max_bytes=2**24)
GPU_WORK = WorkSize(width=4096, batch=256, rounds=16, calls=5, max_bytes=2**30)
# Quick mode (CI, a 2-core CPU): the CPU's sizes, timed in the fewest pairs whose 90 % interval can still support a
# verdict (5), one step per block, and at most 20 calls per round of a collective.
QUICK_WORK = WorkSize(width=512, batch=64, rounds=5, calls=1, max_bytes=2**24, iters=20)


def work_size(device) -> WorkSize:
    """The work of ranks on ``device``: GPU sizes for CUDA ranks in full mode, CPU sizes otherwise, and in quick mode
    the CPU's sizes timed in fewer, shorter blocks.

    Sized by the backend, not by the machine: gloo processes on the CPU get CPU-sized work in full mode too (on a
    one-GPU machine the multi-rank runs are gloo on the CPU, and a GPU's sizes there take longer than a launch's
    time limit).
    """
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    kind = kind.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"work_size is for 'cpu' (gloo) or 'cuda' (NCCL) ranks; got {device!r}")
    if quick_mode():
        return QUICK_WORK
    return GPU_WORK if kind == "cuda" else CPU_WORK


def interleaved(fns: dict, *, rounds: int, calls: int = 1, warmup: int = 1, before=None, sync=None,
                clock=time.perf_counter) -> dict:
    """Seconds per call of each function, timed in ``rounds`` blocks of ``calls`` calls each, interleaved.

    Round r times the functions in order, round r+1 in reverse order (A B C, C B A, A B C, ...), so that a
    change in the machine's load hits every configuration alike, and block i of one function and block i of
    another are a pair for ``gpulab.Comparison.of``. Each function is called ``warmup`` times first. Before each
    block: ``sync()`` (e.g. ``torch.cuda.synchronize``), then ``before()`` (e.g. a barrier, so that the ranks
    start together); after the block's calls, ``sync()`` again before the clock is read.
    """
    if not fns:
        raise ValueError("interleaved() needs at least one function to time")
    for name, value in (("rounds", rounds), ("calls", calls)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of 1 or more; got {value!r}")
    sync = sync or (lambda: None)
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            sync()
            if before is not None:
                before()
            start = clock()
            for _ in range(calls):
                fns[name]()
            sync()
            times[name].append((clock() - start) / calls)
    return times
