"""The planning numbers of `make verify-gpu`: the minutes each part is expected to take (measured where a run
measured them, with the GPU and date; else marked as estimates), and the rules that decide what one command runs:
the parts in order of need, each started only where its expected minutes fit what is left of the budget.

Pure functions of the shipped results and the numbers below: `make verify-gpu-plan` shows them on a CPU.
"""

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

H100 = "NVIDIA H100 80GB HBM3"  # the GPU a plan is for where there is none to ask (the course's first GPU rows)
VERIFY_NAME = "verify_gpu"  # the shipped results that hold the minutes each part took, per GPU
# Kept at the end of a budget: a part that overran is stopped, and left behind if its processes do not end
# (verify_jobs.GRACE_S + END_S), before the last bundle is written and the monitor stopped (verify.FINAL_S).
RESERVE_S = 45.0
PART_CAP_S = 8 * 60.0  # no part runs longer: a lent GPU machine runs one command for at most 10 minutes
SMOKE_LESSON_LIMIT_S = 180.0  # a lesson in quick mode, however contended (the slowest took 119 s, nine at once)
SMOKE_LIMIT_S = 300.0  # the whole smoke run: every lesson's limit is cut so that it ends by then


@dataclass(frozen=True)
class Minutes:
    """The minutes a part is expected to take on one GPU, and where that number comes from."""
    minutes: float
    measured: bool
    basis: str  # the run that measured it; or what an estimate rests on
    gpu: str = ""
    date: str = ""
    ran: float = 0.0  # the minutes it ran on this GPU class last time before it failed or was stopped

    def source(self) -> str:
        if self.measured:
            return f"measured on {self.gpu}, {self.date}: {self.basis}"
        return f"estimate: {self.basis}"

    def stop_s(self, cap_s: float = PART_CAP_S) -> float:
        """When the part is stopped: ``stop_limit_s`` of its minutes, or of the minutes it ran last time before it
        failed or was stopped where those are longer, so that it may get past where it stopped."""
        return stop_limit_s(max(self.minutes, self.ran), cap_s)


def measured(seconds: float, gpu: str, date: str, basis: str) -> Minutes:
    return Minutes(round(seconds / 60, 1), True, basis, gpu, date)


def estimate(minutes: float, basis: str) -> Minutes:
    return Minutes(minutes, False, basis)


H200_RUN = "2026-11-27"  # the course at main 7832b00 on one NVIDIA H200 (the run's log.txt)

# Minutes per part on one H100 (80 GB, 16 CPU cores). A measurement of this GPU class in the shipped verify_gpu
# results comes before these; measurements here are from other runs, with their GPU, date and course version.
PLANNED = {
    "smoke": measured(156, "NVIDIA H200", H200_RUN, "nine lessons in quick mode at once 119 s, then 05 alone 37 s "
                      "(main 7832b00)"),
    "tests": estimate(2.0, "the ~18 GPU-marked tests in one pytest process, quick sizes"),
    "00": estimate(0.5, "matmul sweep ~8 s (its H100 rows span 7 s), 9 CPU-vs-GPU comparisons, a thread comparison"),
    "01": estimate(1.7, "10 fresh processes for CUDA_LAUNCH_BLOCKING ~27 s, the CUDA C build ~30 s, the rest ~45 s"),
    "02": estimate(1.8, "ResNet-50 at 128 px fed by 5 loader set-ups ~31 s, epoch comparisons ~35 s"),
    "03": estimate(1.6, "from its full-mode sizes and H100 rows: ceilings of 2 precisions ~17 s, the sweep ~10 s, 4 "
                   "comparisons ~9 s, whole-card searches ~12 s, 6 convergence runs of 4 s ~31 s, start and figures ~15 s"),
    "04": estimate(1.4, "one ceiling search per precision ~31 s, 4 x 400 training steps ~18 s, comparisons at 1 s"),
    "05": estimate(1.1, "the lesson's own plan: 1.1 min on an H100 or H200 (13 comparisons of a ~36 ms step, two "
                   "fragmentation processes; estimates); quick mode alone on the H200 took 37 s"),
    "06": estimate(2.0, "the lesson's own plan: 2.0 min on an H100 or H200, its path's races stopped at a 51 s budget "
                   "(the slow loop at batch 32, its profile and HTA ~20 s, three torch.compile runs; estimates)"),
    "07": estimate(1.4, "the lesson's own plan: 1.4 min on an H100 or H200 with one GPU (gloo launches on the CPU ~5 s "
                   "each, a one-rank NCCL run at the planned width; estimates)"),
    "08": estimate(3.0, "the lesson's own plan: 3.0 min on an H100 or H200 at most (gpulab plan: the noise seeds and "
                   "the seven races stopped at one 135 s budget, expected at ~92 s; the naive job at the 2026-11-28 "
                   "H200's ~3,250 images/s of per-sample pipeline, the fast rates and the compile estimated; start, "
                   "ceilings and figures ~45 s)"),
    "09": estimate(1.1, "the lesson's own plan: 1.1 min on an H100 or H200 (three ceilings ~27 s, the first run "
                   "of 60 steps of 8 x 1024 tokens in fp32 ~8 s, the attention sweep to T = 8192 ~5 s, start, FLOP "
                   "counts and figures ~25 s; estimates)"),
    "10": estimate(3.0, "the lesson's own plan: 3.0 min on an H100 or H200, its races and head-to-head stopped at a "
                   "107 s budget (planned at ~65 s: 8 races of 5 pairs at micro-batch 4 x 8 and a first compile ~20 s; "
                   "three ceilings ~27 s, the rest ~45 s; estimates)"),
    "11": estimate(1.3, "the lesson's own plan: 1.3 min on an H100 or H200 (one ceiling ~9 s, checkpointing raced at 32 "
                   "sequences ~5 s, FP8's crossover to n = 32768 ~15 s, the GPT's fp8 race with two compiles ~29 s "
                   "where torchao is installed; estimates)"),
    "bench": estimate(0.5, "gpulab bench"),
}
# What each lesson's full mode is sized to: the whole course in about 15 minutes on one H100 (the waterfalls, 08 and
# 10, in 3).
TARGET_MIN = {**{f"{n:02d}": 2.0 for n in range(12)}, "08": 3.0, "10": 3.0}
# Seconds each lesson took in quick mode, nine at once on one NVIDIA H200 (2026-11-27): contended, so only the order
# the smoke run starts them in (longest first, so the last to start is a short one). Lesson 09 took 93.9 s before it
# was split into 09, 10 and 11: none of the three is measured, so each starts first.
SMOKE_SECONDS = {"00": 15.1, "01": 111.4, "02": 34.0, "03": 28.6, "04": 25.1, "05": 30.1, "06": 104.8, "07": 110.3,
                 "08": 92.7}
# Parts renamed since shipped rows were recorded, and the part that holds what ran then: lesson 09's waterfall, where
# the 2026-11-28 H200 run failed (its CUDA graphs step), is lesson 10 since lesson 09 was split.
SUCCESSORS = {"09_transformers": "10_gpt_made_fast"}
# Lessons that take the whole card in quick mode: the smoke run runs them alone, after the others. None now: 05's
# OOM demo runs inside a cap (64 MiB above what it holds), and 03 searches the whole card only in full mode.
WHOLE_CARD_QUICK = ()


def expected(key: str, name: str, gpu: str, shipped: pd.DataFrame) -> Minutes:
    """The minutes part ``key`` (``name``: its full name, as verify_gpu rows hold it) is expected to take on
    ``gpu``: those of its latest run on that GPU class in ``shipped`` (verify_gpu rows) if it passed, else
    ``PLANNED``. A run that failed or was stopped measured nothing: the planning number stays, with the minutes it
    ran then (``Minutes.stop_s`` lets it run past them)."""
    table = PLANNED.get(key, estimate(PART_CAP_S / 60, "no planning number: the part's limit"))
    last = _last_run(shipped, name, gpu)
    if last is None:
        return table
    seconds, date = float(last["seconds"]), str(last.get("recorded_at", ""))[:10]
    if last["status"] == "passed":
        return measured(seconds, gpu, date, "make verify-gpu")
    return replace(table, ran=round(seconds / 60, 1), basis=f"{table.basis}; its last run on {gpu} ({date}) "
                   f"{_ended(last)} after {seconds / 60:.1f} min and measured nothing")


def stop_limit_s(minutes: float, cap_s: float = PART_CAP_S) -> float:
    """When a part is stopped: at twice its expected minutes (at least one minute more), at most ``cap_s``; so
    that a part far over its plan does not take the others' time."""
    return min(cap_s, 60 * max(2 * minutes, minutes + 1))


def fits(minutes: float, left_s: float) -> bool:
    """Whether a part expected to take ``minutes`` may start with ``left_s`` seconds of the budget left."""
    return minutes * 60 <= left_s - RESERVE_S


def reference_gpus(reference_dir: Path) -> dict[str, set[str]]:
    """The GPU classes (``device_name``) each part has shipped reference rows for: lessons by number, "bench"."""
    found: dict[str, set[str]] = {}
    for csv in sorted(Path(reference_dir).glob("*.csv")):
        if csv.stem == VERIFY_NAME:
            continue
        key = csv.stem[:2] if csv.stem[:2].isdigit() else csv.stem
        try:
            names = pd.read_csv(csv, usecols=["device_name"])["device_name"].dropna().astype(str)
        except (ValueError, OSError, pd.errors.ParserError, pd.errors.EmptyDataError):
            continue
        found.setdefault(key, set()).update(names)
    return found


def need(key: str, name: str, lesson: bool, gpu: str, shipped: pd.DataFrame,
         gpus: dict[str, set[str]]) -> tuple[tuple, str]:
    """How much part ``key`` needs running on ``gpu``: a sort key (lowest first) and why, in words. First the parts
    that failed or were stopped at their limit the last time they ran on this GPU class (is it fixed?), then the
    lessons with no reference rows for it, then the parts never timed on it, then those timed on it, oldest first."""
    last = _last_run(shipped, name, gpu)
    if last is not None and last["status"] != "passed":
        formerly = f", as {last['part']}" if last["part"] != name else ""
        return (0, ""), (f"{_ended(last)} last time on {gpu} ({str(last.get('recorded_at', ''))[:10]}{formerly}: "
                         f"{_how(last)})")
    if last is not None:
        when = str(last.get("recorded_at", ""))
        return (3, when), f"measured on this GPU class {when[:10]}"
    if lesson and gpu not in gpus.get(key, set()):
        return (1, ""), "no reference rows for this GPU class"
    return (2, ""), "not timed on this GPU class yet"


def order(parts: list, gpu: str, shipped: pd.DataFrame, gpus: dict[str, set[str]],
          failed_quick: set[str] = frozenset()) -> list[tuple]:
    """``parts`` (with ``key``, ``name``, ``notebook``) in the order a budgeted run starts them, each with why;
    lessons that failed in quick mode go last. Stable: the course order within a level."""
    ranked = []
    for index, part in enumerate(parts):
        rank, why = need(part.key, part.name, part.notebook is not None, gpu, shipped, gpus)
        failed = part.key in failed_quick
        if failed:
            why = f"{why}; last: it failed in quick mode"
        ranked.append(((failed, rank, index), part, why))
    return [(part, why) for _, part, why in sorted(ranked, key=lambda r: r[0])]


def plan_rows(parts: list, gpu: str, budget_s: float | None, shipped: pd.DataFrame, gpus: dict[str, set[str]],
              cap_s: float = PART_CAP_S) -> pd.DataFrame:
    """What one command would run on ``gpu`` within ``budget_s`` (None: no budget), had each part taken its
    expected minutes: the smoke run first, then the full-mode parts in order of need, each with its minutes, their
    source, its stop limit and the decision."""
    left = math.inf if budget_s is None else budget_s
    rows = []
    smoke = [p for p in parts if p.key == "smoke"]
    ordered = ([(p, "first: every lesson in quick mode") for p in smoke]
               + order([p for p in parts if p.key != "smoke"], gpu, shipped, gpus))
    for part, why in ordered:
        minutes = expected(part.key, part.name, gpu, shipped)
        target = TARGET_MIN.get(part.key)
        over = f"; over its {target:g}-minute target" if target is not None and minutes.minutes > target else ""
        if part.key == "smoke" or fits(minutes.minutes, left):
            decision = "runs" if budget_s is None else f"runs, ends by {(budget_s - left) / 60 + minutes.minutes:.1f} min"
            left -= minutes.minutes * 60
        else:
            decision = f"not run: {max(0.0, (left - RESERVE_S) / 60):.1f} min left"
        limit = SMOKE_LIMIT_S if part.key == "smoke" else minutes.stop_s(cap_s)
        rows.append({"part": part.key, "runs": part.what, "minutes": minutes.minutes,
                     "source": minutes.source() + over, "stop_min": round(limit / 60, 1), "why": why,
                     "decision": decision})
    return pd.DataFrame(rows, columns=["part", "runs", "minutes", "source", "stop_min", "why", "decision"])


def _last_run(shipped: pd.DataFrame, name: str, gpu: str) -> pd.Series | None:
    """The latest verify_gpu row of part ``name`` on ``gpu``, or of the part it succeeds (``SUCCESSORS``); None: it
    never ran there."""
    if shipped.empty or not {"part", "device_name", "status"} <= set(shipped):
        return None
    part = shipped["part"].map(lambda recorded: SUCCESSORS.get(recorded, recorded))
    rows = shipped[(part == name) & (shipped["device_name"] == gpu)]
    rows = rows.sort_values("recorded_at", kind="stable") if "recorded_at" in rows else rows
    return None if rows.empty else rows.iloc[-1]


def _ended(row: pd.Series) -> str:
    """How a run that did not pass ended: "failed" or "timed out"."""
    return "timed out" if row["status"] == "timed out" else "failed"


def _how(row: pd.Series, width: int = 64) -> str:
    """What a run that did not pass said, in one short line: a stopped run's limit (and the cell it was running, where
    its row names it), a failed run's error."""
    detail = row.get("detail")
    detail = detail if isinstance(detail, str) else ""
    if row["status"] == "timed out":
        cell = re.search(r"while code cell \d+ ran", detail)
        limit = row.get("limit_s")
        minutes = float(limit if pd.notna(limit) else row["seconds"]) / 60
        return f"stopped at its {minutes:.1f}-minute limit" + (f" {cell[0]}" if cell else "")
    first = detail.split(". ")[0] or "no error recorded"
    return first if len(first) <= width else first[:width - 3] + "..."
