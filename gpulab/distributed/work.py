"""How many ranks a lesson runs and how much work each gets (``WorkSize``: lesson 07's plan sizes it from the card),
and ``interleaved``: configurations timed in short blocks, in alternating order, inside a launched script (its pairs
go to ``gpulab.Comparison.of``).
"""

import time
from dataclasses import dataclass

import numpy as np

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
    """How much work each rank of a lesson's launches does (lesson 07's plan chooses it: ``gpulab.plans.plan07``)."""

    width: int  # of the WideMLP trained
    batch: int  # samples per rank and step
    rounds: int  # interleaved rounds of a timing: the pairs of each comparison
    calls: int  # steps per timed block
    max_bytes: int  # the largest collective timed (0: none)
    iters: int = 100  # the most calls of a collective per timed round (the smallest messages; fewer for larger ones)

    def args(self) -> list:
        """The command-line arguments of lesson 07's scripts for these sizes (``gpulab.distributed.rank.script_args``
        reads them)."""
        return ["--width", self.width, "--batch", self.batch, "--rounds", self.rounds, "--calls", self.calls,
                "--max-bytes", self.max_bytes, "--iters", self.iters]

    def __str__(self) -> str:
        steps = f"{self.calls} step{'s' * (self.calls != 1)}"
        shown = f"WideMLP width {self.width}, {self.batch} samples a rank, {self.rounds} rounds of {steps} a comparison"
        if self.max_bytes:  # 0: a run that times no collectives
            shown += f", collectives up to {self.max_bytes / 2**20:g} MiB ({self.iters} calls a round at most)"
        return shown


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
