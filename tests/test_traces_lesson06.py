"""Lesson 06's GPU-only cells, run here on the CPU: the cells themselves, read from the notebook, with what a GPU would
give them substituted where the CPU cannot (a real GPU trace instead of the shipped reference trace, ``on_gpu`` set
where the cell's code runs on any device). nbval runs the notebook's CPU branches; these run its GPU branches."""

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch

from gpulab import Comparison, traces

from .test_traces_real_gpu import key_averages_of

matplotlib.use("Agg")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_profiling.ipynb"
MI250 = Path(__file__).parent / "data" / "gpu-traces" / "mi250_minitoy_train_trace.json.gz"


def code_cells() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def cell(starting_with: str) -> str:
    """The source of the one code cell of lesson 06 that starts with ``starting_with``."""
    found = [source for source in code_cells() if source.startswith(starting_with)]
    assert len(found) == 1, f"{len(found)} cells of {NOTEBOOK.name} start with {starting_with!r}"
    return found[0]


def run(source: str, scope: dict) -> str:
    """Run a cell's source in ``scope`` (the notebook's globals so far); what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pd.option_context("display.width", 200, "display.max_columns", 30):
        exec(compile(source, f"<{NOTEBOOK.name}>", "exec"), scope)
    plt.close("all")
    return out.getvalue()


@pytest.fixture
def lesson(results_dir, monkeypatch):
    """The notebook's globals after its setup and imports cells, in quick mode, results in a temporary folder."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__"}
    for source in code_cells()[:3]:  # the setup cell, the plan, then the lesson's imports and sizes
        run(source, scope)
    return scope


def test_section_5_reads_a_real_gpu_trace_with_gpulab_and_hta_side_by_side(lesson, monkeypatch):
    """With a GPU trace shipped (here the MI250 one), section 5 shows gpulab's and HTA's numbers on a CPU."""
    provenance = {"device_name": "AMD MI250 (HTA's test data)"}
    monkeypatch.setattr(traces, "reference_trace", lambda name="06_trace": (traces.load_trace(MI250), provenance))
    cpu_trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": 5}
        for name, start in (("ProfilerStep#1", 0), ("data", 0), ("forward", 1), ("ProfilerStep#2", 6), ("data", 6))]}
    lesson.update(trace=cpu_trace, has_kernels=False)  # this machine's own trace: a CPU one
    printed = run(cell("hta_ok, hta_version"), lesson)
    assert "The same from HTA" in printed
    temporal = lesson["temporal"].iloc[0]
    assert temporal["busy_ms"] == pytest.approx(temporal["compute_ms"] + temporal["non_compute_ms"])
    assert "largest idle category is host_wait on stream 0" in printed
    assert "(The shipped trace of the slow loop on AMD MI250 (HTA's test data), not a trace of this machine" in printed
    assert "What the CPU did in each profiled step of the slow loop, from this machine's own trace" in printed


def test_the_cudnn_section_reports_the_autotuning_and_the_steady_state(lesson, results_dir, cuda_stand_in):
    """The GPU branch of the cudnn.benchmark cell, on the CPU playing a GPU (where the flag changes nothing): it times
    the first steps at new shapes and the steady state at one shape, each as interleaved pairs, and says which the
    claim is about."""
    lesson["on_gpu"] = True
    printed = run(cell("if on_gpu:\n    cnn = "), lesson)
    first, steady = lesson["first_steps"], lesson["steady"]
    assert isinstance(first, Comparison) and isinstance(steady, Comparison)
    assert first.pairs >= 5 and steady.pairs >= 5
    assert "first step at a new shape (autotuning included): benchmark=True" in printed
    assert "steady state, one shape: benchmark=True" in printed
    assert "The claim (faster convolutions, in the steady state):" in printed
    assert torch.backends.cudnn.benchmark is False  # left as it was found
    rows = pd.read_csv(results_dir / "06_cudnn_benchmark.csv")
    assert set(rows["label"]) == {"first step at a new shape (autotuning included)", "steady state, one shape"}
    assert {"speedup", "speedup_low", "speedup_high", "verdict"} <= set(rows.columns)


def test_the_alloc_free_pattern_counts_cuda_mallocs_and_retries_and_times_the_fixes_without_the_profiler(
        lesson, monkeypatch):
    """The GPU branch of the patterns cell, on the CPU: cudaMalloc/cudaFree from the trace's runtime calls, the
    caching allocator's counters (none move on a CPU), and each fix timed against its pattern without the profiler.
    Each profile's operator table is a GPU profile's (the MI250 run's), with CUDA runtime calls in it."""
    gpu_ops = traces.op_table(key_averages_of(MI250))
    monkeypatch.setattr(traces, "op_table", lambda prof, **options: gpu_ops)
    lesson.update(on_gpu=True, path=SimpleNamespace(parts={"slow": {"busy_share": 0.00094}}))
    printed = run(cell("def profile_once"), lesson) + run(cell("# Each fix timed without the profiler"), lesson)
    assert "200 temporaries on the GPU: 0 cudaMalloc and 0 cudaFree calls" in printed
    assert "kept the GPU busy 0.1% of its profiled steps" in printed  # 0.094 %, not "0%"
    table = pd.DataFrame(lesson["pattern_rows"]).set_index("pattern")
    n = lesson["n_temporaries"]
    # two new tensors per iteration, as the text says, and none into a buffer (no Python number wrapped as a tensor)
    assert table.loc["frequent alloc/free: temporaries", "allocations"] == 2 * n
    assert table.loc["frequent alloc/free: temporaries", "allocated MB"] == pytest.approx(2 * n * 256 * 256 * 4 / 1e6)
    assert table.loc["  fixed: into a buffer", "allocations"] == 0
    operators = gpu_ops.loc[gpu_ops["kind"] == "operator", "calls"].sum()  # not the 21 hipLaunchKernel calls too
    assert (table["op calls"] == operators).all() and operators < gpu_ops.loc[~gpu_ops["is_range"], "calls"].sum()
    assert "num_alloc_retries 0" in printed and "after torch.cuda.empty_cache()" in printed
    fixes = lesson["pattern_fixes"]
    assert set(fixes) == {"one op instead of tiny ops in a loop", "a buffer instead of temporaries"}
    assert all(isinstance(c, Comparison) and c.pairs >= 5 for c in fixes.values())
    assert "Timed without the profiler, a buffer instead of temporaries:" in printed


def test_section_4_shows_busy_kernel_and_idle_time_per_step_of_a_real_gpu_trace(lesson):
    """The GPU branch of the busy-time cell, on the MI250 trace: two steps (not three windows), each split into
    kernels, copies only and idle, next to NVML's samples (none on a CPU: the monitor says why)."""
    run(cell("n_images = "), lesson)  # the loop the monitor watches
    run(cell("def make_run("), lesson)
    lesson.update(on_gpu=True, has_kernels=True, trace=traces.load_trace(MI250))
    printed = run(cell("if has_kernels:\n    busy = traces.gpu_busy"), lesson)
    busy = lesson["busy"]
    assert list(busy["step"]) == [1, 2]
    parts = lesson["parts"]
    segments = parts[["kernels running", "only copies or memsets", "idle"]].sum(axis=1)
    assert segments.to_numpy() == pytest.approx(busy["step_ms"].to_numpy())
    kernel_share = busy["kernel_ms"].sum() / busy["step_ms"].sum()
    assert f"a kernel ran {kernel_share:.1%} of its profiled steps' time" in printed
    nvml = "without the profiler averaged" if lesson["monitor"].available else "NVML's utilisation: not available here"
    assert nvml in printed  # without NVML: said so, not "nan%"


def test_section_3_reads_operators_and_kernels_of_a_gpu_profile_apart(lesson):
    """The tables cell on a profile with kernels in it (the MI250 run's, rebuilt with torch's own classes): operators
    by their own kernels' time, kernels by theirs, and the device time counted once in each."""
    averaged = key_averages_of(MI250)  # the profiler as the cell reads it: its key_averages(), and torch's table of it
    lesson.update(on_gpu=True, prof=SimpleNamespace(key_averages=lambda group_by_input_shape=False: averaged))
    printed = run(cell("table = traces.op_table(prof)"), lesson)
    assert "Top operators by self device time" in printed and "Top kernels and copies by device time" in printed
    assert "torch's own table, by self CPU time" in printed and "Self CPU time total" in printed
    assert lesson["ranges"].index.is_unique
    assert "Device time of the operators: 0.15 ms; of the kernels, copies and memsets: 0.15 ms" in printed
    assert set(lesson["kernels"]["device_type"]) == {"CUDA"} and set(lesson["table"]["device_type"]) == {"CPU"}


# ----- what the H200 run printed wrong (issue 28), each cell run on a real H200 trace or injected measurements -----

H200 = Path(__file__).parent / "data" / "lesson06"
H200_SLOW = H200 / "h200_slow_trace.json.gz"


def comparison(before_s, after_s, labels):
    """Five interleaved pairs of constant times: the medians and the speed-up are exactly these."""
    return Comparison.of([before_s] * 5, [after_s] * 5, labels=labels)


class FakeMonitor:
    """NVML as a GPU machine's Monitor reports it: a few samples of 12 % utilisation."""

    available, reason = True, ""

    def __init__(self, interval):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def frame(self):
        return pd.DataFrame({"time_s": [0.0, 0.05, 0.1], "phase": "", "gpu_util_pct": [10.0, 12.0, 14.0]})

    def mean(self):
        return 12.0


def test_section_4_says_what_nvml_counts_beside_the_busy_share_of_the_slow_loops_own_trace(lesson):
    """On the H200 the cell printed "a kernel ran 0% ... NVML ... averaged 12%": a share of 0.09 % rounded to 0, and
    NVML's number with no word on what it counts (every process's kernels, however small)."""
    run(cell("n_images = "), lesson)
    run(cell("def make_run("), lesson)
    lesson.update(on_gpu=True, has_kernels=True, trace=traces.load_trace(H200_SLOW), Monitor=FakeMonitor)
    printed = run(cell("if has_kernels:\n    busy = traces.gpu_busy"), lesson)
    assert "From the trace of the slow loop, a kernel ran 0.1% of its profiled steps' time" in printed
    assert "the GPU ran anything (kernels, copies, memsets) 0.1%" in printed
    assert ("NVML's utilisation over the same loop without the profiler averaged 12%: the share of its sample periods "
            "in which any kernel ran on this GPU, from any process, however small") in printed


def test_section_4_says_what_a_ranges_gpu_side_spans():
    """The H200 run showed each step's GPU side lasting about 2 µs (one GPU event of the 217 its step launched:
    tests/test_lesson06_h200_traces.py), where the text had said it spanned the step's kernels."""
    text = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    assert "spanning the kernels" not in text and "spanning the\nkernels" not in text
    assert "only the GPU work launched *directly* inside the range" in " ".join(text.split())


def test_the_summary_reports_each_compiled_step_against_its_own_eager_baseline(lesson):
    """On the H200 the summary read "eager 2.63 ms, torch.compile 2.57 ms, ...; torch.compile: slower": the eager time
    was the last comparison's, so the numbers said faster and the verdict slower. Each way is its own comparison's
    speed-up and verdict."""
    launch_gains = {"torch.compile": comparison(2.057e-3, 2.574e-3, ("eager", "torch.compile")),
                    "torch.compile + CUDA graphs": comparison(2.627e-3, 1.571e-3, ("eager", "torch.compile + CUDA graphs"))}
    path = SimpleNamespace(rows=[], speedup=lambda: 1.0, verdict=lambda: "the path's verdict")
    lesson.update(on_gpu=True, path=path, slow=SimpleNamespace(median=0.29825 * lesson["steps"]),
                  launch_gains=launch_gains, eager_alone=None, activations={}, worst=None, overhead={})
    printed = run(cell('print(f"device: {device}'), lesson)
    assert "slow loop: 298.25 ms per step; kept: no fix, their median speed-ups multiplied 1.00× (each raced" in printed
    assert ("launch-bound step: torch.compile 0.80× eager's speed, slower; torch.compile + CUDA graphs 1.67× eager's "
            "speed, faster") in printed
    assert "the path's verdict" in printed


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_on_a_gpu_the_lesson_sets_the_tf32_precision_it_trains_in_before_anything_compiles(
        results_dir, monkeypatch, matmul_precision):
    """Inductor warned "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled" on
    the H200 (torch 2.11 warns while matmuls are not TF32 on a GPU of compute capability 8.0 or newer). The imports
    cell, run as on such a GPU, sets the precision, so the condition of that warning is false."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    torch.set_float32_matmul_precision("highest")
    scope = {"__name__": "__main__"}
    setup, planned, imports = code_cells()[:3]
    run(setup, scope)
    run(planned, scope)
    scope["device"] = torch.device("cuda")  # as on the H200
    run(imports, scope)
    assert scope["on_gpu"] and torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # what inductor checks before it warns


def profilers_started(source: str):
    """Each ``with profile(...)`` in a cell's source: (line, whether it passes acc_events=True)."""
    import ast

    for node in ast.walk(ast.parse(source)):
        for item in getattr(node, "items", []) if isinstance(node, ast.With) else []:
            call = item.context_expr
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "profile":
                keep = any(k.arg == "acc_events" and getattr(k.value, "value", None) is True for k in call.keywords)
                yield call.lineno, keep


@pytest.mark.parametrize("notebook", ["notebooks", "solutions", "exercises"])
def test_every_profiler_lesson_06_starts_keeps_its_events_so_that_torch_warns_nothing(notebook):
    """torch 2.11 warns "Profiler clears events at the end of each cycle" when any profiler starts without
    acc_events=True, schedule or not (the H200 run showed it in the patterns section)."""
    path = NOTEBOOK.parents[1] / notebook / NOTEBOOK.name
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    found = [(i, line, keep) for i, source in enumerate(cells) for line, keep in profilers_started(source)]
    assert found and all(keep for _, _, keep in found), [(i, line) for i, line, keep in found if not keep]


@pytest.mark.gpu
def test_on_a_gpu_the_loop_with_every_fix_trains_under_the_profiler_and_its_trace_names_a_bottleneck(
        results_dir, monkeypatch, matmul_precision, tmp_path):
    """Every fix of section 6's path at once (data on the device, torch.compile + CUDA graphs among them) on a real
    GPU: it trains (the loss stays finite), the profiler records its replayed graphs, and the trace reads as the path
    reads it."""
    from torch.profiler import profile, schedule

    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__"}
    for source in code_cells()[:3]:
        run(source, scope)
    run(cell("n_images = "), scope)
    run(cell("def make_run("), scope)
    fixes = [name for name, *_ in _path_fixes()]  # every fix of section 6's path
    model, optimizer, loader = scope["make_run"](fixes)
    path = tmp_path / "trace.json"
    with profile(activities=scope["activities"], schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path)), acc_events=True) as prof:
        loss = scope["train"](model, optimizer, loader, 4, fixes, prof)
    assert torch.isfinite(torch.tensor(loss))
    found = traces.bottleneck(path)
    assert found.bound in ("GPU", "CPU", "launch overhead", "other") and 0 < found.busy_share <= 1
    assert traces.gpu_busy(path)["kernels"].gt(0).all()


def test_section_7_counts_operator_calls_apart_from_cuda_runtime_calls(lesson):
    """On the H200: "One eager step at batch 16: 269 operator calls", a count that held the cudaLaunchKernel calls too.
    Here the step's profile is a GPU profile's table (the MI250 run's: 70 operator calls, 21 runtime calls)."""
    gpu_ops = traces.op_table(key_averages_of(MI250))
    lesson.update(on_gpu=True, run_compile=False, profile_once=lambda fn, profile_memory=False: (gpu_ops, None))
    decides = "run_compile = on_gpu or not plan.quick\n"  # nothing compiles here: eager alone
    source = cell("small_batch = 16")
    assert decides in source
    source = source.replace(decides, "")
    printed = run(source, lesson)
    assert printed.startswith("One eager step at batch 16: 70 operator calls and 21 CUDA runtime calls, ")


def _path_fixes() -> list:
    """The fixes section 6 races, as its cell lists them."""
    import ast

    source = cell("fixes = [")
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "fixes")
    return ast.literal_eval(node.value)
