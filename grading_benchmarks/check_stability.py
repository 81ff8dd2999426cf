"""How steady are the course's timed checks? Each one's shown solution and its unchanged baseline, checked N times.

    python grading_benchmarks/check_stability.py --runs 20 --busy 2      # beside two busy processes, as a loaded laptop

A timed check must pass a right answer on a busy machine and never pass the baseline itself: the table counts
passes per answer, with the median speed-up each run measured. Rows go to results/check_stability.csv.
This is a benchmark, not a test: it takes minutes (lesson 08's check trains several models per run).
"""

import argparse
import re
import subprocess
import sys
import time
from contextlib import contextmanager

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import gpulab
from gpulab import capstone
from gpulab.questions import lesson06, lesson08
from gpulab.results import results_dir


def slow_epoch_as_answer(model, optimizer, images, labels, batch_size):
    """Lesson 06's baseline, handed in as an answer."""
    return lesson06.slow_epoch(model, optimizer, images, labels, batch_size)


def slow_train_as_answer(model, data, *, epochs, device):
    """Lesson 08's baseline, handed in as an answer."""
    capstone.slow_train(model, data, epochs=epochs, device=device)


CHECKS = {  # name: (question, {answer: function})
    "06q3": (lesson06.q3, {"shown solution": lambda: lesson06.q3.shown("fast_epoch", torch=torch, F=F),
                           "baseline": lambda: slow_epoch_as_answer}),
    "08q1": (lesson08.q1, {"shown solution": lambda: lesson08.q1.shown("fast_train", torch=torch, F=F,
                                                                         capstone=capstone, gpulab=gpulab),
                           "baseline": lambda: slow_train_as_answer}),
}


@contextmanager
def busy(processes: int):
    """``processes`` Python processes spinning on a core each, for the duration of the block."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def run(checks: list[str], runs: int) -> pd.DataFrame:
    rows = []
    for name in checks:
        question, answers = CHECKS[name]
        for answer, make in answers.items():
            for i in tqdm(range(runs), desc=f"{name}, {answer}"):
                start = time.perf_counter()
                question.check(make())
                speedup = re.search(r"([0-9.]+)× (?:\(median|as fast)", question.last.message)
                rows.append({"check": name, "answer": answer, "run": i, "passed": question.last.status == "correct",
                             "speedup": float(speedup.group(1)) if speedup else float("nan"),
                             "seconds": time.perf_counter() - start, "message": question.last.message})
    return pd.DataFrame(rows)


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    grouped = frame.groupby(["check", "answer"], sort=False)
    return pd.DataFrame({"passed": grouped["passed"].sum().astype(int).astype(str) + "/" + grouped.size().astype(str),
                         "median speed-up": grouped["speedup"].median().round(2),
                         "range": grouped["speedup"].min().round(2).astype(str) + "–"
                         + grouped["speedup"].max().round(2).astype(str),
                         "seconds per run": grouped["seconds"].median().round(1)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="checks per answer (default 20)")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the checks (default 0)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"which checks (default {','.join(CHECKS)})")
    args = parser.parse_args(argv)
    checks = args.checks.split(",")
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown or args.runs < 1 or args.busy < 0:
        parser.error(f"unknown checks {unknown} (known: {', '.join(CHECKS)})" if unknown else "runs >= 1, busy >= 0")
    with busy(args.busy):
        frame = run(checks, args.runs)
    out = results_dir() / "check_stability.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.assign(busy=args.busy).to_csv(out, index=False)
    print(f"{args.runs} runs per answer, beside {args.busy} busy processes, on {torch.get_num_threads()} threads:")
    print(summary(frame).to_string())
    print(f"every run: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
