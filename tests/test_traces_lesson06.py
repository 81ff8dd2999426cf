"""Lesson 06's GPU-only cells, run here on the CPU: the cells themselves, read from the notebook, with what a GPU would
give them substituted where the CPU cannot (a real GPU trace instead of the shipped reference trace, ``on_gpu`` set
where the cell's code runs on any device). nbval runs the notebook's CPU branches; these run its GPU branches."""

import contextlib
import io
from pathlib import Path

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
    setup, imports = code_cells()[:2]  # the setup cell, then the lesson's imports and sizes
    run(setup, scope)
    run(imports, scope)
    return scope


def test_section_5_reads_a_real_gpu_trace_with_gpulab_and_hta_side_by_side(lesson, monkeypatch):
    """With a GPU trace shipped (here the MI250 one), section 5 shows gpulab's and HTA's numbers on a CPU."""
    provenance = {"device_name": "AMD MI250 (HTA's test data)"}
    monkeypatch.setattr(traces, "reference_trace", lambda name="06_trace": (traces.load_trace(MI250), provenance))
    lesson.update(trace=None, slow_trace=Path("06_slow.json"))  # this machine's own trace: a CPU one, not used
    printed = run(cell("hta_ok, hta_version"), lesson)
    assert "The same from HTA" in printed and "HTA's rounding to whole µs is the difference" in printed
    causes = lesson["causes"]
    assert causes["HTA"].to_numpy() == pytest.approx(causes["gpulab, rounded as HTA rounds"].to_numpy(), abs=1e-5)
    assert causes.loc["host_wait", "HTA"] > causes.loc["host_wait", "gpulab, the trace's own timestamps"]
    temporal = lesson["temporal"].iloc[0]
    assert temporal["busy_ms"] == pytest.approx(temporal["compute_ms"] + temporal["non_compute_ms"])
    assert "largest idle category is host_wait on stream 0" in printed
    assert "   step " in printed and "kernel_share" in printed  # the shipped trace's busy time per step: two steps
    busy = traces.gpu_busy(MI250)
    assert list(busy["step"]) == [1, 2]


def test_the_cudnn_section_reports_the_autotuning_and_the_steady_state(lesson, results_dir):
    """The GPU branch of the cudnn.benchmark cell, on the CPU (where the flag changes nothing): it times the first
    steps at new shapes and the steady state at one shape, each as interleaved pairs, and says which the claim is
    about."""
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
    lesson.update(on_gpu=True, busy_shares={"slow": 0.00094})
    printed = run(cell("def profile_once"), lesson)
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
    lesson.update(on_gpu=True, trace=traces.load_trace(MI250))
    printed = run(cell("if on_gpu:\n    busy = traces.gpu_busy"), lesson)
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
    lesson.update(on_gpu=True, prof=key_averages_of(MI250))
    printed = run(cell("table = traces.op_table(prof)"), lesson)
    assert "Top operators by self device time" in printed and "Top kernels and copies by device time" in printed
    assert lesson["ranges"].index.is_unique
    assert "Device time of the operators: 0.15 ms; of the kernels, copies and memsets: 0.15 ms" in printed
    assert set(lesson["kernels"]["device_type"]) == {"CUDA"} and set(lesson["table"]["device_type"]) == {"CPU"}


# ----- what the H200 run printed wrong (issue 28), each cell run on a real H200 trace or injected measurements -----

H200 = Path(__file__).parent / "data" / "lesson06"
H200_SLOW, H200_SIX_FIXES = H200 / "h200_slow_trace.json.gz", H200 / "h200_six_fixes_trace.json.gz"
SIX_FIXES = ["augment on the device", "pinned copies", "no .item() per step", "vectorised", "fused optimizer",
             "mixed precision"]


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
    lesson.update(on_gpu=True, trace=traces.load_trace(H200_SLOW), Monitor=FakeMonitor)
    printed = run(cell("if on_gpu:\n    busy = traces.gpu_busy"), lesson)
    assert "From the trace of the slow loop, a kernel ran 0.1% of its profiled steps' time" in printed
    assert "the GPU ran anything (kernels, copies, memsets) 0.1%" in printed
    assert ("NVML's utilisation over the same loop without the profiler averaged 12%: the share of its sample periods "
            "in which any kernel ran on this GPU, from any process, however small") in printed


def test_section_4_shows_each_ranges_gpu_side_as_the_h200_trace_has_it(lesson):
    """The H200 trace: each step's GPU side lasts about 2 µs and holds one GPU event of the 217 its step launched;
    the text said it spanned the step's kernels. The cell prints both sides from the trace."""
    lesson.update(on_gpu=True, trace=traces.load_trace(H200_SLOW))
    printed = run(cell("try:\n    spans = traces.range_spans"), lesson)
    assert ("ProfilerStep#2: 415.48 ms on the CPU, which launched 217 GPU events meanwhile; its GPU side lasts "
            "0.0018 ms and holds 1 of them.") in printed
    assert ("backward: 7.95 ms on the CPU, which launched 33 GPU events meanwhile; its GPU side lasts 0.0008 ms and "
            "holds 1 of them.") in printed
    assert set(lesson["first_step"]["step"]) == {2}
    text = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    assert "spanning the kernels" not in text and "spanning the\nkernels" not in text
    assert "only the GPU work launched *directly* inside the range" in " ".join(text.split())


def test_section_4_on_a_cpu_says_the_ranges_have_no_gpu_side_here(lesson, tmp_path):
    cpu_trace = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 5}]}
    lesson.update(trace=cpu_trace)
    printed = run(cell("try:\n    spans = traces.range_spans"), lesson)
    assert printed.startswith("The ranges' GPU side: this trace has no GPU kernels")


def test_section_6_prints_each_fix_with_the_medians_of_its_own_comparison(lesson):
    """On the H200, "+ vectorised 9.89 → 10.91 ms per step: 1.14× the speed": the first number came from another
    comparison, so the step times said slower while the speed-up said faster. Each line's times are now the two
    medians its speed-up was read from."""
    steps = lesson["steps"]
    gains = {"+ augment on the device": comparison(0.400, 0.040, ("slow", "+ augment on the device")),
             "+ vectorised": comparison(0.050, 0.044, ("+ augment on the device", "+ vectorised"))}  # not 0.040
    overall = comparison(0.380, 0.046, ("slow", "all fixes"))
    phases = {p: 1.0 for p in (*traces.PHASES, "other")}
    top = pd.DataFrame({"operator": ["aten::a", "aten::b", "aten::c"]})
    lesson.update(on_gpu=True, by="self_device_ms", gains=gains, overall=overall, tops={"slow": top, "+ vectorised": top},
                  phase_rows=[{"variant": v, **phases} for v in ("slow", *gains)],
                  busy_shares={"slow": 0.00094, "+ vectorised": 0.022})
    printed = run(cell("with plots.style():\n    fig, (top, bottom)"), lesson)
    per_step = 1e3 / steps
    for name, c in gains.items():
        before, after = c.baseline_times[0] * per_step, c.candidate_times[0] * per_step
        assert f"{name:<26} {before:8.2f} → {after:8.2f} ms per step: {c.speedup:.2f}× the speed" in printed
    assert f"All fixes together, on cpu: {0.380 * per_step:.2f} → {0.046 * per_step:.2f} ms per step, 8.26×" in printed
    assert "0.1% in the slow loop, 2.2% with every fix above" in printed


def six_fix_lesson(lesson, next_traces):
    """Section 6b's scope after section 6 on a GPU, the loop with six fixes profiled on the H200; profiling a next
    variant returns ``next_traces[name]``, and timing it runs nothing."""
    run(cell("n_images = "), lesson)
    calls = []

    def profile_variant(name, fixes):
        calls.append((name, fixes))
        lesson["runs"][name] = (None, None, None, fixes)
        return traces.load_trace(next_traces[name]), None

    lesson.update(on_gpu=True, names=["slow", "+ mixed precision"], rows=[], busy_shares={},
                  runs={"+ mixed precision": (None, None, None, SIX_FIXES)},
                  variant_traces={"+ mixed precision": traces.load_trace(H200_SIX_FIXES)},
                  profile_variant=profile_variant, timed=lambda name: (lambda: None),
                  comparing={"pairs": 5, "number": 1}, fix_log=lesson["gpulab"].ResultLog("06_fixes"))
    return calls


def gpu_bound_trace():
    """Two 1 ms steps in which kernels run nearly all the time."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
               "ts": (n - 1) * 1000.0, "dur": 999} for n in (1, 2)]
    for i in range(20):
        events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 0.0,
                    "dur": 2, "args": {"correlation": i}},
                   {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10 + 100 * i, "dur": 98,
                    "args": {"correlation": i, "stream": 7}}]
    return {"traceEvents": events}


def test_section_6b_says_the_six_fix_loop_is_not_fixed_and_stops_when_the_trace_says_the_gpu_is_the_bottleneck(
        lesson, results_dir):
    """The H200 run ended at six fixes with the GPU 98 % idle and called the loop fixed. Now the six-fix trace is read
    (the CPU is the bottleneck), the next fix is profiled and timed, and the loop stops once a trace says GPU."""
    calls = six_fix_lesson(lesson, {"+ data on the device": gpu_bound_trace()})
    printed = run(cell("def diagnosis(name):"), lesson)
    assert printed.startswith("'+ mixed precision' (section 6's fixes): the CPU is the bottleneck, not the GPU: the GPU "
                              "ran kernels, copies or memsets 2.2% of the profiled steps' time, and 96% of its idle "
                              "time was host wait")
    assert calls == [("+ data on the device", SIX_FIXES + ["data on the device"])]  # no CUDA graphs: not needed
    assert "+ data on the device: 0.00 → 0.00 ms per step" in printed and "Its trace: the GPU is the bottleneck" in printed
    assert "The loop is fixed: the trace of '+ data on the device' says the GPU is the bottleneck" in printed
    row = pd.read_csv(results_dir / "06_fixes.csv").iloc[-1]
    assert row["variant"] == "+ data on the device"
    assert row["gpu_busy_share"] == pytest.approx(traces.bottleneck(gpu_bound_trace()).busy_share)
    assert {"step_ms", "before_step_ms", "speedup", "verdict"} <= set(row.index)


def test_section_6b_says_what_is_left_when_the_fixes_run_out_before_the_gpu_is_the_bottleneck(lesson):
    calls = six_fix_lesson(lesson, {"+ data on the device": H200_SIX_FIXES, "+ torch.compile + CUDA graphs": H200_SIX_FIXES})
    printed = run(cell("def diagnosis(name):"), lesson)
    assert [name for name, _ in calls] == ["+ data on the device", "+ torch.compile + CUDA graphs"]
    assert calls[-1][1] == SIX_FIXES + ["data on the device", "torch.compile + CUDA graphs"]
    cpu = traces.phase_times(H200_SIX_FIXES).drop(columns="step").mean()
    assert ("Not fixed yet: after every fix of this lesson the trace of '+ torch.compile + CUDA graphs' still says the "
            "CPU is the bottleneck, not the GPU") in printed
    assert f"went mostly to 'data' ({cpu.max():.2f} of {cpu.sum():.2f} ms)" in printed
    assert "fixed:" not in printed.lower().replace("not fixed yet:", "")


def test_the_summary_reports_each_compiled_step_against_its_own_eager_baseline(lesson):
    """On the H200 the summary read "eager 2.63 ms, torch.compile 2.57 ms, ...; torch.compile: slower": the eager time
    was the last comparison's, so the numbers said faster and the verdict slower."""
    launch_gains = {"torch.compile": comparison(2.057e-3, 2.574e-3, ("eager", "torch.compile")),
                    "torch.compile + CUDA graphs": comparison(2.627e-3, 1.571e-3, ("eager", "torch.compile + CUDA graphs"))}
    steps = lesson["steps"]
    lesson.update(on_gpu=True, overall=comparison(0.29825 * steps, 0.00925 * steps, ("slow", "all fixes")),
                  gains={}, next_gains={}, names=["slow", "+ mixed precision"], current="+ mixed precision",
                  busy_shares={"slow": 0.00094, "+ mixed precision": 0.022}, said="the CPU is the bottleneck",
                  launch_gains=launch_gains, eager_alone=None, activations={}, worst=None, overhead={})
    printed = run(cell('print(f"device: {device}'), lesson)
    assert "slow loop: 298.25 ms per step; with section 6's fixes: 9.25 ms, 32.24× the speed" in printed
    assert ("launch-bound step: torch.compile 2.57 ms against eager's 2.06 ms, slower; torch.compile + CUDA graphs "
            "1.57 ms against eager's 2.63 ms, faster") in printed
    assert "slow 0.1%, + mixed precision 2.2%" in printed
    assert "what limits '+ mixed precision', from its trace: the CPU is the bottleneck" in printed


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
    setup, imports = code_cells()[:2]
    run(setup, scope)
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
    """Section 6b's last variant (data on the device, torch.compile + CUDA graphs) on a real GPU: it trains (the loss
    stays finite), the profiler records its replayed graphs, and the trace reads as section 6b reads it."""
    from torch.profiler import profile, schedule

    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__"}
    for source in code_cells()[:2]:
        run(source, scope)
    run(cell("n_images = "), scope)
    fixes = scope["FIXES"] + scope["NEXT_FIXES"]
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
    decides = "run_compile = on_gpu or not gpulab.quick_mode()\n"  # nothing compiles here: eager alone
    source = cell("small_batch = 16")
    assert decides in source
    source = source.replace(decides, "")
    printed = run(source, lesson)
    assert printed.startswith("One eager step at batch 16: 70 operator calls and 21 CUDA runtime calls, ")
