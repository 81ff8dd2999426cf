"""Lesson 06's fixes raced as a path: each fix switched on over the loop kept so far, the candidate profiled (its own
trace) and timed without the profiler against the kept loop in interleaved pairs, kept when faster beyond the noise
(``racing.Path``); the path stops where the kept loop's trace says the GPU is the bottleneck, and its races stop at a
``racing.Budget``.

A fix can shorten only the part of a step it acts on, so a fix that is not kept is explained from the traces
(``why``): how long that part took in the kept loop's profiled step, and so the most the fix could give if the part went
away entirely (Amdahl's law); who set the pace there (a fix of the GPU's work cannot shorten a step the CPU sets); and
how long the part took in the candidate's own trace. The loop and the fixes themselves are the lesson's, written out in
its cells; this module profiles nothing itself, it only decides, explains and records.

    path = FixPath(profiled_loop, start_s=slow.median, budget=racing.Budget(plan.budget_s), ...)
    path.run([Fix("vectorised", ("data",)), Fix("mixed precision", ("kernels",), needs_gpu="...")])
    path.report()
"""

import gc
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from . import plots, racing, traces
from .comparison import Comparison, compare
from .plans.plan06 import PROFILED, TRACE_S
from .plans.predict import compare_s
from .results import ResultLog

# The parts of a profiled step a fix can shorten: the loop's record_function ranges on the CPU (traces.PHASES), the
# CPU's waits for the GPU, and on the GPU its host-to-device copies and its kernels.
PARTS = {**{p: f"the CPU's '{p}' range" for p in traces.PHASES}, "waits": "the CPU's waits for the GPU",
         "copies": "the copies to the GPU", "kernels": "the GPU's kernels"}
GPU_PARTS = ("copies", "kernels")
# The CUDA (or HIP) runtime calls in which the CPU waits for the GPU: what .item(), a blocking copy or a synchronize
# costs the CPU. .item() copies the value with at::cuda::memcpy_and_sync, a cudaMemcpyAsync then a
# cudaStreamSynchronize (aten/src/ATen/native/cuda/CUDAScalar.cu, c10/cuda/CUDAFunctions.h, torch 2.6 to 2.14), and a
# copy between host and device without non_blocking=True goes through the same call (copy_kernel_cuda in
# aten/src/ATen/native/cuda/Copy.cu): the H200's trace of the slow loop holds three a step.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "hipStreamSynchronize",
         "hipDeviceSynchronize")
PROFILED_STEPS = 4  # the steps the lesson's profiled_loop runs under the profiler (skip 1, warm up 1, record 2)


@dataclass(frozen=True)
class Fix:
    """One fix of the path: its name, the parts of a step it can shorten (keys of ``PARTS``), and why a CPU cannot show
    it ("" where one can)."""

    name: str
    shortens: tuple[str, ...]
    needs_gpu: str = ""


@dataclass(frozen=True)
class Tried:
    """A race of the path: the candidate's speed over the kept loop (``comparison``), and where each one's profiled
    step went (``where_time_went`` of the kept loop's trace and of the candidate's)."""

    comparison: Comparison
    kept: dict
    candidate: dict


def where_time_went(trace) -> dict:
    """Milliseconds per profiled step of ``trace``: ``step_ms`` (the steps' windows), each part of ``PARTS`` and, on a
    GPU trace, ``kernels_per_step``, ``busy_share``, ``bound`` and ``said`` (what ``traces.bottleneck`` says limits the
    steps, and in its words). A CPU's trace has no GPU parts (NaN) and no waits (0)."""
    trace = traces.load_trace(trace)
    windows = traces.steps(trace)
    n, start, end = len(windows), windows["start_ms"].min(), windows["end_ms"].max()
    frame = traces.events(trace)
    frame = frame[(frame["start_ms"] >= start) & (frame["start_ms"] < end)]
    waits = frame[frame["cat"].isin(traces.RUNTIME_CATEGORIES) & frame["name"].isin(WAITS)]
    parts = {"step_ms": float((windows["end_ms"] - windows["start_ms"]).mean()),
             **traces.phase_times(trace).drop(columns=["step", "other"]).mean().to_dict(),
             "waits": waits["dur_ms"].sum() / n, "copies": math.nan, "kernels": math.nan}
    if traces.has_device_events(trace):
        busy, found = traces.gpu_busy(trace), traces.bottleneck(trace)
        copies = frame[(frame["kind"] == "memcpy") & frame["name"].str.contains("HtoD")]
        parts.update(copies=copies["dur_ms"].sum() / n, kernels=float(busy["kernel_ms"].mean()),
                     kernels_per_step=float(busy["kernels"].mean()), busy_share=found.busy_share, bound=found.bound,
                     said=str(found))
    return parts


def why(fix: Fix, kept_name: str, tried: Tried) -> str:
    """What the traces say of a fix raced over the loop ``kept_name``: the part it shortens in the kept loop's step, the
    most it could give, who set the pace, and the same part in its own trace."""
    kept, own = tried.kept, tried.candidate
    part, step = sum(kept[p] for p in fix.shortens), kept["step_ms"]
    most = step / (step - part) if part < step else math.inf
    text = (f"it shortens {in_words(fix.shortens)}: {part:.2f} ms of a {step:.2f} ms profiled step of '{kept_name}' "
            f"({part / step:.0%}; at most {most:.2f}× if that went away)")
    if "bound" in kept:
        on_gpu = set(fix.shortens) <= set(GPU_PARTS)
        if on_gpu and kept["bound"] != "GPU":
            text += (f"; the CPU set the pace there (the GPU busy {kept['busy_share']:.1%} of the step), so the GPU's "
                     "time saved is time it waited anyway")
        elif not on_gpu and kept["bound"] == "GPU":
            text += f"; the GPU set the pace there (busy {kept['busy_share']:.1%}), so the CPU's time saved hides behind it"
    own_part = sum(own[p] for p in fix.shortens)
    return text + f"; in its own trace {own_part:.2f} ms of a {own['step_ms']:.2f} ms step"


def in_words(parts) -> str:
    """Parts of a step as a sentence says them: "the copies to the GPU and the CPU's waits for the GPU"; ranges
    together: "the CPU's 'forward' and 'backward' ranges"."""
    ranges = [p for p in parts if p in traces.PHASES]
    named = [PARTS[p] for p in parts if p not in ranges]
    if len(ranges) > 1:
        named.append(f"the CPU's {' and '.join(repr(p) for p in ranges)} ranges")
    elif ranges:
        named.append(PARTS[ranges[0]])
    return " and ".join(named)


class FixPath:
    """The fixes of a training loop raced one by one (``racing.Path``) over the loop kept so far.

    ``profiled_loop(fixes)`` is the lesson's: a fresh run of the loop with ``fixes`` (a list of names), a few steps
    under the profiler; it returns the trace and a function that trains that run ``steps`` steps more, unprofiled (one
    timed run). ``start_s`` is the seconds of one run of the starting loop (to plan the first race); ``comparing`` the
    options of ``gpulab.compare`` for each race, ``against_start`` for a race against the starting loop (whose runs
    are long); each call a race times is one run (``number=1``: compare sizes no blocks with calls of its own, which
    the plan would not count); ``startup_s`` the seconds a fix's first call costs (compiling), the first time and
    again. Every verdict goes to the results log ``log`` as it is given, with ``columns`` (the loop's sizes) in each
    row."""

    def __init__(self, profiled_loop: Callable, *, steps: int, start_s: float, budget: racing.Budget, comparing: dict,
                 against_start: dict, startup_s: dict | None = None, start: str = "slow", log: str = "06_fixes",
                 columns: dict | None = None):
        self.profiled_loop, self.steps, self.start, self.budget = profiled_loop, steps, start, budget
        self.comparing, self.against_start = {**comparing, "number": 1}, {**against_start, "number": 1}
        self.startup_s = startup_s or {}
        self.log, self.columns = ResultLog(log), columns or {}
        self.fixes, self.parts, self.runs, self.why, self._started = {}, {}, {}, {}, set()
        self.seconds = {start: start_s}  # one timed run of each configuration, as measured so far
        self.path = racing.Path(self._race, judge=lambda tried: None, row=self._row, current=(start, {}),
                                log=self._logged)

    @property
    def kept(self) -> str:
        """The name of the loop kept so far (the start's, or the last fix kept)."""
        return self.path.current[0]

    @property
    def kept_fixes(self) -> list[str]:
        return list(self.path.current[1])

    @property
    def rows(self) -> list[dict]:
        return self.path.rows

    def run(self, fixes: Sequence, *, on_gpu: bool = True) -> "FixPath":
        """Profile the starting loop, race each fix in turn (a ``Fix``, or its fields as a tuple; ``needs_gpu`` says
        why it cannot run where not ``on_gpu``), then once more each fix dropped for its speed where a later one was
        kept."""
        fixes = [f if isinstance(f, Fix) else Fix(f[0], tuple(f[1]), *f[2:]) for f in fixes]
        self.fixes.update({fix.name: fix for fix in fixes})
        trace, self.runs[self.start] = self.profiled_loop([])
        self.parts[self.start] = where_time_went(trace)
        for fix in fixes:
            cannot = fix.needs_gpu if fix.needs_gpu and not on_gpu else None
            self.path.step(fix.name, {fix.name: True}, cannot or self.refuses(fix.name, {fix.name: True}))
        self.path.again(not_here=self.refuses)
        return self

    def refuses(self, name: str, options: dict) -> str | None:
        """Why a race is not started now: the kept loop's trace says the GPU is the bottleneck or holds nothing the
        fix shortens, or the race would not end within the budget (None: it runs)."""
        kept = self.parts[self.kept]
        fix = self.fixes[next(iter(options))]
        if kept.get("bound") == "GPU":
            return f"not needed: the trace of '{self.kept}' says the GPU is the bottleneck"
        if not sum(kept[p] for p in fix.shortens) > 0:
            return f"not raced: the trace of '{self.kept}' holds none of {in_words(fix.shortens)}"
        planned = self.planned_s(name, options)
        refused = self.budget.refuses(planned) if self.path.rows else None  # the first race always runs
        if not refused:
            left = self.budget.left()
            print(f"racing {name}: planned {planned:.0f} s" + (f", {left:.0f} s left" if math.isfinite(left) else ""))
        return refused

    def planned_s(self, name: str, options: dict) -> float:
        """A race's seconds before it starts: the candidate profiled, then its interleaved pairs with the kept loop,
        the candidate planned at the kept loop's time; and the first call of each fix that compiles."""
        run_s = self.seconds[self.kept]
        timing = self.against_start if self.kept == self.start else self.comparing
        pairs = compare_s(run_s, run_s, min_time=timing.get("min_time", 1.0), pairs=timing.get("pairs"))
        profile = PROFILED_STEPS * run_s / self.steps * PROFILED + TRACE_S
        candidate = {**self.path.current[1], **options}
        startup = sum(self.startup_s[f][1 if f in self._started else 0] for f in candidate if f in self.startup_s)
        return profile + pairs + startup

    def _race(self, current: tuple, candidate: tuple) -> Tried:
        (kept, _), (name, options) = current, candidate
        trace, self.runs[name] = self.profiled_loop(list(options))
        self._started.update(options)
        self.parts[name] = where_time_went(trace)
        timing = self.against_start if kept == self.start else self.comparing
        c = compare(self.runs[kept], self.runs[name], labels=(kept, name), **timing)
        self.seconds[kept], self.seconds[name] = statistics.median(c.baseline_times), statistics.median(c.candidate_times)
        return Tried(c, self.parts[kept], self.parts[name])

    def _row(self, tried: Tried, options: dict) -> dict:
        steps, name = self.steps, tried.comparison.candidate
        fix = self.fixes[name.removesuffix(" (again)")]
        self.why[name] = why(fix, tried.comparison.baseline, tried)
        return {"fixes": " + ".join(options), "step_ms": self.seconds[name] / steps * 1e3,
                "before_step_ms": self.seconds[tried.comparison.baseline] / steps * 1e3,
                "gpu_busy_share": tried.candidate.get("busy_share", math.nan), "why": self.why[name]}

    def _logged(self, row: dict, tried: Tried | None) -> None:
        self.log.add(**self.columns, **{k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))})
        if tried is not None:  # only the kept loop's run is raced again: the candidate's goes when it is dropped
            self.runs.pop(tried.comparison.baseline if row["kept"] else tried.comparison.candidate, None)
            gc.collect()

    # ---- what the path found ------------------------------------------------------------------------------------

    def table(self) -> pd.DataFrame:
        """One row per step: the milliseconds a step of the kept loop and of the candidate took in their race, the
        speed-up with its interval, the GPU's busy share in the candidate's own trace, and kept or why not."""
        rows = [{"step": r["step"], "ms a step before": r.get("before_step_ms", math.nan),
                 "after": r.get("step_ms", math.nan),
                 "speed-up (interval)": f"{r['vs_previous']:.2f}× ({r['low']:.2f}–{r['high']:.2f})" if "low" in r else "",
                 "GPU busy": r.get("gpu_busy_share", math.nan), "note": r["note"]} for r in self.path.rows]
        return pd.DataFrame(rows).set_index("step")

    def speedup(self) -> float:
        """The kept steps' median speed-ups multiplied, each raced against the loop before it: the fixed loop against
        the start as a product of medians, without an interval (the two were not raced against each other)."""
        return math.prod(r["vs_previous"] for r in self.path.rows if r.get("kept"))

    def verdict(self) -> str:
        """Where the path ended, from the kept loop's own trace: the GPU is the bottleneck, or what still holds it
        back."""
        parts = self.parts[self.kept]
        phases = {p: parts[p] for p in traces.PHASES}
        largest = max(phases, key=phases.get)
        where = f"'{largest}' ({phases[largest]:.2f} ms of a {parts['step_ms']:.2f} ms profiled step)"
        if "bound" not in parts:
            return (f"No GPU here: in the trace of '{self.kept}' the CPU spent most of its step in {where}; whether "
                    "the GPU is the bottleneck needs a GPU.")
        said = parts["said"]
        if parts["bound"] == "GPU":
            return (f"The loop is fixed: the trace of '{self.kept}' says {said}. More speed now means less GPU work a "
                    "step (lower precision, fused or better kernels), not a better loop.")
        return (f"Not fixed yet: the trace of '{self.kept}' says {said}. What holds it back is the CPU's work, most "
                f"of it in {where}: fewer launches there (torch.compile, CUDA graphs) or more work a launch (a larger "
                "batch, lesson 03) is what is left.")

    def report(self) -> pd.DataFrame:
        """The path's table, its figure, each fix not kept with what the traces say of it, and where the path ended."""
        from IPython.display import display

        table = self.table()
        display(table.dropna(axis=1, how="all").round(3))
        self.figure()
        plt.show()
        for row in self.path.rows:
            if row["note"] in (racing.WITHIN_NOISE, racing.SLOWER_HERE):
                print(f"{row['step']}: {row['note']} ({row['vs_previous']:.2f}×): {self.why[row['step']]}.")
            elif not row["kept"]:
                print(f"{row['step']}: {row['note']}.")
        print(f"\nThe kept fixes' median speed-ups multiplied: {self.speedup():.2f}× the {self.start} loop's speed "
              f"(each raced against the loop before it; a product, no interval: the {self.start} loop was not raced "
              f"against the fixed one). {self.verdict()}")
        return table

    def figure(self):
        """Left, the waterfall of the races (kept steps in green); right, where each profiled loop's CPU time went."""
        ran = [r for r in self.path.rows if "vs_previous" in r]
        with plots.style():
            fig, (left, right) = plt.subplots(1, 2, figsize=(16, 4.5), layout="constrained")
        if ran:
            plots.waterfall([r["step"] for r in ran], [r["vs_previous"] for r in ran], kept=[r["kept"] for r in ran],
                            intervals=[(r["low"], r["high"]) for r in ran], lost_label=None,
                            kept_label="kept: faster beyond the noise", title="Each fix against the loop kept before it",
                            ax=left)
            left.set_ylabel(f"speed-up over the {self.start} loop")
        phases = pd.DataFrame([{"loop": name, **{p: parts[p] for p in traces.PHASES}}
                               for name, parts in self.parts.items()])
        plots.stacked(phases, list(traces.PHASES), label="loop", title="Where a profiled step's CPU time went", ax=right)
        return fig
