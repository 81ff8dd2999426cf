"""Lesson 06's fixes raced as a path (gpulab.fix_path, the lesson's section 6): a fix is kept only when it is faster
beyond the noise; a fix that is not kept is explained from the traces (the part of the step it shortens, how long that
part took in the kept loop's trace, the most the fix could give, who set the pace); the path stops where the trace
says the GPU is the bottleneck and says what holds the loop back where it does not; its races stop at the budget.

Timings are injected (each race's comparison scripted, never a threshold on a real timing). The GPU's traces are the
lesson's own from the 2026-11-28 H200 run in quick mode (tests/data/lesson06/README.md), where the lesson kept
"+ pinned copies" at 0.93× and "+ mixed precision" at 0.81× and printed the per-step sync's 1.03× without a word on
why."""

import ast
import contextlib
import itertools
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

import gpulab
from gpulab import fix_path, racing, traces
from gpulab.comparison import Comparison
from gpulab.plans.predict import compare_s
from gpulab.timing import Measurement

from .test_mfu_lessons_03_04 import code

DATA = Path(__file__).parent / "data" / "lesson06"
ORDER = ["augment on the device", "pinned copies", "no .item() per step", "vectorised", "fused optimizer",
         "mixed precision", "data on the device", "torch.compile + CUDA graphs"]  # the H200 run's order, 1 to 8
# Each fix against the variant before it on that run (06_fixes.csv): the median speed-up and its interval
H200_TIMINGS = {"augment on the device": (3.54, 3.09, 4.40), "pinned copies": (0.93, 0.82, 0.96),
                "no .item() per step": (1.03, 0.78, 1.14), "vectorised": (1.42, 1.28, 1.45),
                "fused optimizer": (1.32, 1.25, 1.34), "mixed precision": (0.81, 0.77, 0.90),
                "data on the device": (1.20, 1.19, 1.28), "torch.compile + CUDA graphs": (1.49, 1.28, 1.60)}


def h200_trace(n: int) -> dict:
    return traces.load_trace(DATA / f"h200_quick_{n}_fixes_trace.json.gz")


def scripted(speedup: float, low: float, high: float, labels) -> Comparison:
    """Five interleaved pairs whose median speed-up is ``speedup`` and whose interval is (low, high)."""
    ratios = [low, speedup, speedup, speedup, high]
    return Comparison.of([1.0] * 5, [1 / r for r in ratios], labels=labels)


class ScriptedRaces:
    """Stands in for gpulab.compare in fix_path: each race's comparison by its candidate's name."""

    def __init__(self, timings: dict):
        self.timings, self.raced = timings, []

    def __call__(self, baseline, candidate, *, labels, **options):
        self.raced.append(labels)
        return scripted(*self.timings[labels[1]], labels)


def lesson_cell(marker: str) -> str:
    return code("06", marker)


def without(source: str, name: str) -> str:
    """A cell's source without its top-level definition of ``name`` (the test gives its own)."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if getattr(node, "name", None) != name]
    return ast.unparse(tree)


@pytest.fixture
def quiet(monkeypatch):
    """Figures and tables go nowhere."""
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    monkeypatch.setattr("IPython.display.display", lambda *args, **kwargs: None)
    yield
    plt.close("all")


def lesson_scope(*markers: str) -> dict:
    """The notebook's globals after its setup, plan and imports cells (and the cells with ``markers``), quick mode."""
    scope = {"__name__": "__main__"}
    for marker in ("device = gpulab.setup()", 'plans.lesson("06")', "from gpulab import fix_path", *markers):
        exec(compile(lesson_cell(marker), f"<lesson 06: {marker}>", "exec"), scope)
    return scope


# ----- the lesson's path on the H200's own traces and timings ------------------------------------------------


@pytest.fixture(scope="module")
def h200_path(tmp_path_factory):
    """Section 6 as it runs on a GPU, on this CPU playing the H200, in quick mode: each configuration's trace is the
    H200's of the same fixes (the candidate's fix names it), each race's comparison the H200's measured one. Run once
    for the tests below: (the notebook's globals, the races, what it printed)."""
    import contextlib
    import io

    import matplotlib.pyplot as plt

    from .cuda_stand_in import installed

    races = ScriptedRaces({**H200_TIMINGS, "mixed precision (again)": (1.01, 0.90, 1.10)})

    def profiled_loop(fixes):
        return h200_trace(ORDER.index(fixes[-1]) + 1 if fixes else 0), lambda: None

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, installed("NVIDIA H200"), contextlib.redirect_stdout(printed):
        mp.setenv("GPULAB_QUICK", "1")
        mp.setenv("GPULAB_RESULTS", str(tmp_path_factory.mktemp("results")))
        mp.setattr(plt, "show", lambda *args, **kwargs: None)
        mp.setattr("IPython.display.display", lambda *args, **kwargs: None)
        mp.setattr(fix_path, "compare", races)
        scope = lesson_scope()
        scope.update(slow=Measurement("slow", (0.08,) * 3, "cuda", 1), profiled_loop=profiled_loop)
        exec(compile(without(lesson_cell("fix_path.FixPath("), "profiled_loop"), "<lesson 06: the path>", "exec"),
             scope)
        rows = pd.read_csv(gpulab.results_dir() / "06_fixes.csv")
    plt.close("all")
    return scope, races, printed.getvalue(), rows


def test_the_path_keeps_only_the_fixes_that_helped_and_explains_the_others_from_their_traces(h200_path):
    """The H200 run kept pinned copies (0.93×) and mixed precision (0.81×); raced as a path with the same timings, only
    the fixes faster beyond the noise are kept, and each one dropped says, from the traces, how much of the kept loop's
    step its part took, the most it could give and who set the pace."""
    scope, races, said, rows = h200_path
    path = scope["path"]
    kept = [row["step"] for row in path.rows if row["kept"]]
    assert kept == ["augment on the device", "vectorised", "fused optimizer", "data on the device",
                    "torch.compile + CUDA graphs"]
    assert path.kept_fixes == kept
    notes = {row["step"]: row["note"] for row in path.rows}
    assert notes["pinned copies"] == notes["mixed precision"] == racing.SLOWER_HERE
    assert notes["no .item() per step"] == racing.WITHIN_NOISE
    # pinned copies, raced over 'augment on the device' (the H200's trace 1: three synchronising calls a step)
    assert ("pinned copies: slower here (0.93×): it shortens the copies to the GPU and the CPU's waits for the GPU: "
            "0.51 ms of a 12.91 ms profiled step of 'augment on the device' (4%; at most 1.04× if that went away); in "
            "its own trace 0.09 ms of a 11.82 ms step.") in said
    # the per-step sync: its own numbers say why it could not show
    assert ("no .item() per step: within noise (1.03×): it shortens the CPU's waits for the GPU: 0.51 ms of a "
            "12.91 ms profiled step of 'augment on the device' (4%; at most 1.04× if that went away)") in said
    # mixed precision, raced over 'fused optimizer' (the H200's trace 5): the CPU set the pace
    assert ("mixed precision: slower here (0.81×): it shortens the GPU's kernels: 0.25 ms of a 6.50 ms profiled step "
            "of 'fused optimizer' (4%; at most 1.04× if that went away); the CPU set the pace there (the GPU busy 3.9% "
            "of the step), so the GPU's time saved is time it waited anyway") in said
    assert list(rows["step"]) == [row["step"] for row in path.rows]
    assert rows.set_index("step").loc["pinned copies", "why"].startswith("it shortens the copies to the GPU")


def test_a_dropped_fix_is_raced_again_once_a_later_fix_was_kept_unless_the_trace_holds_nothing_it_shortens(h200_path):
    """After the last kept fix (CUDA graphs, the H200's trace 8: no copies, no waits), pinned copies and the per-step
    sync have nothing left to shorten: not raced again, and said why; mixed precision is raced again."""
    scope, races, said, rows = h200_path
    again = {row["step"]: row["note"] for row in scope["path"].rows if row["step"].endswith("(again)")}
    nothing = ("not raced: the trace of 'torch.compile + CUDA graphs' holds none of the copies to the GPU and the CPU's "
               "waits for the GPU")
    assert again["pinned copies (again)"] == nothing
    assert again["no .item() per step (again)"] == ("not raced: the trace of 'torch.compile + CUDA graphs' holds none "
                                                    "of the CPU's waits for the GPU")
    assert again["mixed precision (again)"] == racing.WITHIN_NOISE
    assert races.raced[-1] == ("torch.compile + CUDA graphs", "mixed precision (again)")


def test_the_path_ends_saying_what_still_holds_the_loop_back(h200_path):
    scope, races, said, rows = h200_path
    path = scope["path"]
    assert path.kept == "torch.compile + CUDA graphs"
    assert ("Not fixed yet: the trace of 'torch.compile + CUDA graphs' says the CPU is the bottleneck, not the GPU: "
            "the GPU ran kernels, copies or memsets 5.6% of the profiled steps' time") in said
    assert "What holds it back is the CPU's work, most of it in 'backward' (1.73 ms of a 5.15 ms profiled step)" in said
    assert math.isclose(path.speedup(), 3.54 * 1.42 * 1.32 * 1.20 * 1.49, rel_tol=1e-9)
    assert (f"The kept fixes' median speed-ups multiplied: {path.speedup():.2f}× the slow loop's speed (each raced "
            "against the loop before it; a product, no interval: the slow loop was not raced against the fixed "
            "one).") in said  # a product of medians, not a race of the two loops: said so


def test_the_lessons_path_on_this_cpu_keeps_only_faster_fixes_with_its_own_traces(monkeypatch, results_dir, quiet,
                                                                                    capsys):
    """The lesson's section 1 and 6 cells on this CPU, in quick mode, each configuration profiled for real; the races'
    timings injected: vectorised slower at first, faster once the data is on the device; the optimizer within noise.
    The GPU's fixes are not raced here, each with why."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kw: Measurement(label, (0.05,) * 3, "cpu", 1))
    scope = lesson_scope("n_images = batch_size * (steps + 1)", "def make_run(")
    races = ScriptedRaces({"augment on the device": (2.5, 2.2, 2.9), "vectorised": (0.9, 0.85, 0.95),
                           "fused optimizer": (1.01, 0.95, 1.08), "data on the device": (1.3, 1.2, 1.4),
                           "vectorised (again)": (1.2, 1.1, 1.3), "fused optimizer (again)": (1.0, 0.9, 1.1)})
    monkeypatch.setattr(fix_path, "compare", races)
    exec(compile(lesson_cell("fix_path.FixPath("), "<lesson 06: the path>", "exec"), scope)
    said = capsys.readouterr().out
    path = scope["path"]
    assert [row["step"] for row in path.rows if row["kept"]] == ["augment on the device", "data on the device",
                                                                 "vectorised (again)"]
    assert path.kept_fixes == ["augment on the device", "data on the device", "vectorised"]
    notes = {row["step"]: row["note"] for row in path.rows}
    assert notes["pinned copies"] == "pinned memory and asynchronous copies need a GPU"
    assert notes["no .item() per step"] == "on a CPU nothing is queued, so reading the loss never waits"
    assert notes["vectorised"] == racing.SLOWER_HERE and notes["fused optimizer"] == racing.WITHIN_NOISE
    assert "vectorised: slower here (0.90×): it shortens the CPU's 'data' range: " in said
    assert "fused optimizer: within noise (1.01×): it shortens the CPU's 'optimizer' range: " in said
    assert "No GPU here: in the trace of 'vectorised (again)' the CPU spent most of its step in" in said
    for name in ("augment on the device", "vectorised", "data on the device"):  # the CPU's own traces were read
        assert path.parts[name]["step_ms"] > 0 and math.isnan(path.parts[name]["kernels"])


def test_the_data_on_the_device_is_augmented_there_even_where_augmenting_there_was_dropped(monkeypatch, results_dir):
    """The data set on the device holds the raw uint8 images: a path that dropped "augment on the device" (within noise)
    and kept "data on the device" still trains on augmented float images (the lesson raised "mean(): ... Got: Byte" when
    the race dropped it, make test-versions on torch 2.14.1)."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = lesson_scope("n_images = batch_size * (steps + 1)", "def make_run(")
    model, optimizer, loader = scope["make_run"](("data on the device",))
    loss = scope["train"](model, optimizer, loader, 2, ("data on the device",))
    assert math.isfinite(loss)


# ----- the pieces ---------------------------------------------------------------------------------------------


def loop_trace(kernels_us=(), step_us=1000.0, sync_us=0.0) -> dict:
    """Two steps of a loop with its four ranges (data 400 µs, forward 200, backward 200, optimizer 100), ``sync_us`` of
    cudaStreamSynchronize at the end of each step, and kernels (start, duration in µs from the first step's start),
    each launched 5 µs before it starts."""
    events = []
    for n in (0, 1):
        t0 = n * step_us
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n + 1}", "pid": 1, "tid": 1,
                       "ts": t0, "dur": step_us - 1})
        start = t0
        for name, length in (("data", 400), ("forward", 200), ("backward", 200), ("optimizer", 100)):
            events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": start,
                           "dur": length})
            start += length
        if sync_us:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1,
                           "ts": start, "dur": sync_us})
    for i, (start, duration) in enumerate(kernels_us):
        events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": start - 5,
                    "dur": 2, "args": {"correlation": i}},
                   {"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": start, "dur": duration,
                    "args": {"correlation": i, "stream": 7}}]
    return {"traceEvents": events}


BUSY = [(10 + 50 * i, 49) for i in range(40)]  # kernels nearly all the time: the GPU is the bottleneck
IDLE = [(900, 20), (1900, 20)]  # one short kernel a step: the CPU is


def test_where_the_time_went_reads_ranges_waits_and_the_gpus_parts_from_a_trace():
    parts = fix_path.where_time_went(loop_trace(IDLE, sync_us=50))
    assert parts["step_ms"] == pytest.approx(1.0, abs=1e-3)
    assert [parts[p] for p in ("data", "forward", "backward", "optimizer")] == pytest.approx([0.4, 0.2, 0.2, 0.1])
    assert parts["waits"] == pytest.approx(0.05) and parts["copies"] == 0 and parts["kernels"] == pytest.approx(0.02)
    assert parts["bound"] == "CPU" and parts["busy_share"] == pytest.approx(0.02, abs=1e-4)
    on_a_cpu = fix_path.where_time_went(loop_trace())
    assert on_a_cpu["waits"] == 0 and math.isnan(on_a_cpu["kernels"]) and "bound" not in on_a_cpu
    h200 = fix_path.where_time_went(h200_trace(1))  # a blocking copy of x and of y, and .item(): three waits a step
    assert h200["waits"] == pytest.approx(0.507, abs=1e-3) and h200["copies"] == pytest.approx(0.007, abs=1e-3)


def test_a_fix_is_explained_by_the_most_its_part_can_give_and_who_set_the_pace():
    kept, own = fix_path.where_time_went(loop_trace(IDLE)), fix_path.where_time_went(loop_trace(IDLE))
    tried = fix_path.Tried(Comparison.of([1.0] * 5, [1.0] * 5), kept, own)
    cpu_part = fix_path.why(fix_path.Fix("vectorised", ("data",)), "kept", tried)
    assert cpu_part.startswith("it shortens the CPU's 'data' range: 0.40 ms of a 1.00 ms profiled step of 'kept' (40%; "
                               "at most 1.67× if that went away)")
    assert "set the pace" not in cpu_part
    gpu_part = fix_path.why(fix_path.Fix("mixed precision", ("kernels",)), "kept", tried)
    assert "the CPU set the pace there (the GPU busy 2.0% of the step)" in gpu_part
    busy = fix_path.where_time_went(loop_trace(BUSY))
    hidden = fix_path.why(fix_path.Fix("fused optimizer", ("optimizer",)), "kept", fix_path.Tried(
        tried.comparison, busy, busy))
    assert (f"the GPU set the pace there (busy {busy['busy_share']:.1%}), so the CPU's time saved hides behind "
            "it") in hidden


def small_path(traces_by_fix: dict, timings: dict, monkeypatch, budget=None, startup_s=None) -> fix_path.FixPath:
    """A path over synthetic traces (by the candidate's fix; "" the start), with scripted races."""
    monkeypatch.setattr(fix_path, "compare", ScriptedRaces(timings))
    loop = lambda fixes: (traces_by_fix[fixes[-1] if fixes else ""], lambda: None)  # noqa: E731
    return fix_path.FixPath(loop, steps=4, start_s=0.4, budget=budget or racing.Budget(),
                            comparing=dict(min_time=0.3, pairs=5), against_start=dict(pairs=5, number=1),
                            startup_s=startup_s)


def test_a_race_runs_the_calls_its_plan_counts(results_dir):
    """gpulab.compare sized its blocks with one call of each side before its pairs, which the plan's compare_s does not
    count: each race after the first ran a pair more than planned (about 14 %). A race's calls are runs of several
    steps: one call a run (number=1), as many calls as the plan counts."""
    calls = {"": 0, "data on the device": 0}

    def loop(fixes):
        name = fixes[-1] if fixes else ""
        return loop_trace(IDLE), lambda: calls.__setitem__(name, calls[name] + 1)

    path = fix_path.FixPath(loop, steps=4, start_s=0.4, budget=racing.Budget(), comparing=dict(min_time=0.0),
                            against_start=dict(min_time=0.0))
    path.run([("data on the device", ["data"])])
    planned = compare_s(1.0, 1.0, min_time=0.0) / 2  # the calls of each side in a race of 1-second calls
    assert calls == {"": planned, "data on the device": planned} == {"": 7, "data on the device": 7}


FIXES = [("data on the device", ["data"]), ("no .item() per step", ["waits"]),
         ("torch.compile + CUDA graphs", ["forward", "backward"])]


def test_the_path_stops_where_the_kept_loops_trace_says_the_gpu_is_the_bottleneck(monkeypatch, results_dir):
    path = small_path({"": loop_trace(IDLE, sync_us=50), "data on the device": loop_trace(BUSY)},
                      {"data on the device": (2.0, 1.8, 2.2)}, monkeypatch)
    path.run(FIXES)
    notes = [row["note"] for row in path.rows]
    gpu_bound = "not needed: the trace of 'data on the device' says the GPU is the bottleneck"
    assert notes == [racing.KEPT, gpu_bound, gpu_bound]
    assert path.verdict().startswith("The loop is fixed: the trace of 'data on the device' says the GPU is the "
                                     "bottleneck")


def test_a_race_that_would_not_end_within_the_budget_is_not_started(monkeypatch, results_dir, capsys):
    """The first race always runs; the compile's start-up is planned into its race, which the budget refuses."""
    idle = loop_trace(IDLE, sync_us=50)
    path = small_path({"": idle, "data on the device": idle, "no .item() per step": idle},
                      {"data on the device": (2.0, 1.8, 2.2), "no .item() per step": (1.2, 1.1, 1.3)}, monkeypatch,
                      budget=racing.Budget(60.0), startup_s={"torch.compile + CUDA graphs": (100.0, 50.0)})
    path.run(FIXES)
    rows = {row["step"]: row for row in path.rows}
    assert rows["data on the device"]["kept"] and rows["no .item() per step"]["kept"]
    refused = rows["torch.compile + CUDA graphs"]["note"]
    assert refused.startswith("not raced: planned 1") and refused.endswith("s of the lesson's budget left")
    assert "racing no .item() per step: planned" in capsys.readouterr().out


def test_a_fix_kept_by_no_race_leaves_the_start_and_the_verdict_says_so(monkeypatch, results_dir):
    idle = loop_trace(IDLE, sync_us=50)
    path = small_path({"": idle, "data on the device": idle, "no .item() per step": idle,
                       "torch.compile + CUDA graphs": idle},
                      {"data on the device": (1.0, 0.9, 1.1), "no .item() per step": (0.9, 0.85, 0.95),
                       "torch.compile + CUDA graphs": (1.01, 0.95, 1.05)}, monkeypatch)
    path.run(FIXES)
    assert path.kept == "slow" and path.speedup() == 1 and not any(row["kept"] for row in path.rows)
    assert path.verdict().startswith("Not fixed yet: the trace of 'slow' says the CPU is the bottleneck")
    assert "most of it in 'data' (0.40 ms of a 1.00 ms profiled step)" in path.verdict()


def test_the_summary_reads_the_path(monkeypatch, results_dir, capsys):
    """The last cell's lines on the path: what was kept, together, what was dropped and why, where it ended."""
    idle = loop_trace(IDLE, sync_us=50)
    path = small_path({"": idle, "data on the device": idle, "no .item() per step": idle,
                       "torch.compile + CUDA graphs": idle},
                      {"data on the device": (2.0, 1.8, 2.2), "no .item() per step": (0.9, 0.85, 0.95),
                       "torch.compile + CUDA graphs": (1.5, 1.4, 1.6),
                       "no .item() per step (again)": (0.95, 0.9, 0.99)}, monkeypatch)
    path.run(FIXES)
    scope = {"device": torch.device("cuda"), "plan": type("Plan", (), {"card": gpulab.plans.Card.named("NVIDIA H200"),
                                                                        "quick": True})(),
             "slow": Measurement("slow", (0.4,) * 3, "cuda", 1), "steps": 4, "path": path, "launch_gains": {},
             "eager_alone": Measurement("eager", (0.002,) * 3, "cuda", 1), "activations": {}, "worst": None,
             "overhead": {}, "gpulab": gpulab, "display": lambda *args: None}
    exec(compile(lesson_cell("print(path.verdict())"), "<lesson 06: summary>", "exec"), scope)
    said = capsys.readouterr().out
    assert ("slow loop: 100.00 ms per step; kept: data on the device, torch.compile + CUDA graphs, their median "
            "speed-ups multiplied 3.00× (each raced against the loop before it; a product, no interval: the slow loop "
            "was not raced against the fixed one); dropped: no .item() per step (slower here)") in said
    assert "Not fixed yet: the trace of 'torch.compile + CUDA graphs' says the CPU is the bottleneck" in said


@pytest.mark.parametrize("cuda_stand_in, dtype, scaled", [("Tesla T4", torch.float16, True),
                                                          ("NVIDIA L4", torch.bfloat16, False)], indirect=["cuda_stand_in"])
def test_mixed_precision_trains_in_the_cards_precision_with_a_scaler_only_for_fp16(cuda_stand_in, dtype, scaled,
                                                                                    monkeypatch, results_dir):
    """The path races mixed precision only where the kept loop's trace holds kernels (a GPU's), so on the stand-in it
    is not raced: the loop's own branch runs here, as a T4 (fp16, a GradScaler that scales) and an L4 (bf16)."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kw: Measurement(label, (0.05,) * 3, "cpu", 1))
    scalers = []

    class Recorded(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scalers.append(self.is_enabled())

    monkeypatch.setattr(torch.amp, "GradScaler", Recorded)
    scope = lesson_scope("n_images = batch_size * (steps + 1)", "def make_run(")
    assert scope["amp_dtype"] == dtype
    fixes = ["augment on the device", "vectorised", "mixed precision", "no .item() per step"]
    loss = scope["train"](*scope["make_run"](fixes), 3, fixes)
    assert math.isfinite(loss) and scalers[-1] is scaled


# ----- the loop with any subset of the fixes the races keep ----------------------------------------------------------

# Every subset of the fixes that compile nothing: the races keep any of them, as the noise decides (128 loops)
SUBSETS = [list(s) for n in range(8) for s in itertools.combinations(ORDER[:-1], n)]


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")  # the stand-in's CPU
@pytest.mark.parametrize("card", [None, "Tesla T4"], ids=["cpu", "t4"])
def test_the_loop_trains_with_every_subset_of_the_fixes(card, monkeypatch, results_dir):
    """make_run() and train() take whatever the races keep: a race within noise once dropped 'augment on the device'
    and left the data on the device in uint8, which the per-image standardisation then refused ('mean(): ... Got:
    Byte'). Two steps of each of the 128 subsets of the seven fixes that compile nothing, on the CPU and on the CPU
    playing a T4 (its GPU branches: pinned copies, fp16 autocast with a GradScaler): each trains to a finite loss.
    (An L4's bf16 branch: test_mixed_precision_trains_in_the_cards_precision_with_a_scaler_only_for_fp16.)"""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kw: Measurement(label, (0.05,) * 3, "cpu", 1))
    failed = {}
    with contextlib.ExitStack() as stack:
        if card:
            from .cuda_stand_in import installed
            stack.enter_context(installed(card))
        scope = lesson_scope("n_images = batch_size * (steps + 1)", "def make_run(")
        scope["batch_size"] = 4  # the loaders' batch: at the lesson's, the per-image pipeline takes most of the test
        for fixes in SUBSETS:
            try:
                loss = scope["train"](*scope["make_run"](fixes), 2, fixes)
            except Exception as error:  # noqa: BLE001 - every failing subset is reported, with its error
                failed[" + ".join(fixes)] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            else:
                if not math.isfinite(loss):
                    failed[" + ".join(fixes)] = f"loss {loss}"
    assert len(SUBSETS) == 128 and not failed, failed
