"""Does ``gpulab.bench`` agree with ``torch.utils.benchmark`` (and, on a GPU, ``triton.testing.do_bench``)?

``gpulab bench --timers`` or ``python -m gpulab.commands.timer_agreement``. Every timer times the same Python function per case
(a 1-element add, memory-bound adds and copies of several sizes, matmuls), interleaved in one process:
each round runs every timer once on every case, in an order that rotates from round to round, and the
table shows the median of the rounds and the ratios. Warm-cache timers are compared with each other
(``bench`` and ``torch.utils.benchmark.Timer.blocked_autorange``), cold-cache ones likewise (on a GPU,
``bench(cache="cold")`` and ``do_bench``, which flushes the L2 before every call). Every round's numbers
are appended to ``results/timers.csv``.
"""

import argparse
import functools
import statistics

import pandas as pd
import torch
from torch.utils.benchmark import Timer
from tqdm.auto import tqdm

from ..device import get_device, on_gpu
from ..mode import by_mode
from ..results import ResultLog
from ..timing import bench

TOLERANCE = 0.05  # the largest relative difference between two timers that counts as agreement
PAIRS = {"gpulab / torch": ("gpulab", "torch"), "gpulab cold / triton": ("gpulab cold", "triton")}


def cases(device: torch.device) -> dict:
    """The operations to time, each a function of no arguments: {name: fn}."""
    cuda = on_gpu(device)
    one = torch.zeros(1, device=device)
    ops = {"add, 1 element": functools.partial(one.add_, 1)}
    for elements in by_mode(full=[2**20, 2**24, 2**28] if cuda else [2**10, 2**16, 2**20, 2**24],
                            quick=[2**10, 2**20]):
        x, y = (torch.rand(elements, device=device) for _ in range(2))
        out = torch.empty_like(x)
        size = _size(4 * elements)
        ops[f"add, 3 × {size}"] = functools.partial(torch.add, x, y, out=out)
        ops[f"copy, 2 × {size}"] = functools.partial(out.copy_, x)
    for n in by_mode(full=[1024, 4096, 8192] if cuda else [64, 256, 1024], quick=[64, 256]):
        a, b = (torch.randn(n, n, device=device) for _ in range(2))
        ops[f"matmul {n}"] = functools.partial(torch.mm, a, b, out=torch.empty_like(a))
    return ops


def timers(device: torch.device, threads: int, min_time: float) -> dict:
    """The timers to compare, each fn → seconds per call: {name: timer}."""
    found = {
        "gpulab": lambda fn: bench(fn, threads=threads, min_time=min_time).median,
        "torch": lambda fn: Timer("fn()", globals={"fn": fn}, num_threads=threads)
        .blocked_autorange(min_run_time=min_time).median,
    }
    if on_gpu(device):
        found["gpulab cold"] = lambda fn: bench(fn, threads=threads, min_time=min_time, cache="cold").median
        try:
            from triton.testing import do_bench
        except ImportError:
            print("triton is not installed: its do_bench is left out of the comparison")
        else:  # GPU-only: do_bench asks triton's active driver for the GPU (triton/testing.py, do_bench)
            found["triton"] = lambda fn: do_bench(fn, rep=max(1, round(min_time * 1e3)), return_mode="median") / 1e3
    return found


def agreement(device=None, rounds: int | None = None, threads: int = 1, min_time: float | None = None) -> pd.DataFrame:
    """Median seconds per call of every case by every timer over ``rounds`` interleaved rounds, and the ratios."""
    device = get_device(device)
    rounds = rounds or by_mode(full=5, quick=3)
    min_time = min_time or by_mode(full=0.2, quick=0.02)
    ops, found = cases(device), timers(device, threads, min_time)
    log = ResultLog("timers", device=str(device))
    seconds = {(case, name): [] for case in ops for name in found}
    with tqdm(total=rounds * len(ops), desc="timers", unit="case") as progress:
        for r in range(rounds):
            order = list(found)[r % len(found):] + list(found)[:r % len(found)]  # who goes first rotates
            for case, fn in ops.items():
                for name in order:
                    seconds[case, name].append(found[name](fn))
                    log.add(case=case, timer=name, round=r, seconds=seconds[case, name][-1], threads=threads)
                progress.update()
    table = pd.DataFrame({name: {case: statistics.median(seconds[case, name]) for case in ops} for name in found})
    for ratio, (a, b) in PAIRS.items():
        if a in table and b in table:
            table[ratio] = table[a] / table[b]
    table["spread"] = [max((max(s) - min(s)) / statistics.median(s) for s in (seconds[case, name] for name in found))
                       for case in ops]  # how much one timer's rounds disagree with each other
    return table


def render(table: pd.DataFrame) -> str:
    """The table (times in µs), a line per ratio saying how many cases agree within TOLERANCE, and the legend."""
    ratios = [c for c in PAIRS if c in table]
    shown = {c: table[c].map(lambda r: f"{r:.3f}") if c in ratios + ["spread"] else table[c].map(lambda s: f"{s * 1e6:,.2f}")
             for c in table}
    lines = [pd.DataFrame(shown).rename(columns=lambda c: c if c in ratios + ["spread"] else f"{c} (µs)").to_string()]
    for column in ratios:
        inside = ((table[column] - 1).abs() <= TOLERANCE).sum()
        lines.append(f"{column}: {inside} of {len(table)} cases within {TOLERANCE:.0%}")
    lines.append("spread: (slowest - fastest) / median of one timer's rounds, the largest of the timers: "
                 "the noise a ratio is read against")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpulab.commands.timer_agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: 5, quick mode 3)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for every timer (default: 1)")
    args = parser.parse_args(argv)
    print(render(agreement(args.device, args.rounds, args.threads)))
    return 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    raise SystemExit(main())
