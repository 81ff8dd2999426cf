"""gpulab.traces on real GPU traces (recorded on an A100 and an MI250, tests/data/gpu-traces/README.md), so that the
GPU-side code runs here without a GPU: steps, busy and idle time, HolisticTraceAnalysis itself next to gpulab's own
numbers, the CUDA runtime calls, and the operator tables of a profile with kernels in it."""

import copy
import gzip
import json
from pathlib import Path

import pandas as pd
import pytest
from hta.trace_analysis import TraceAnalysis
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent, _rewrite_name

from gpulab import traces
from gpulab.questions.lesson06 import dominant_operator

DATA = Path(__file__).parent / "data" / "gpu-traces"
ALEXNET = DATA / "a100_alexnet_trace.json.gz"   # A100: 2 streams, copies, memsets, cuda_sync records, no steps
MI250 = DATA / "mi250_minitoy_train_trace.json.gz"  # MI250: 2 steps, GPU-side copies of the step ranges
TRITON = DATA / "a100_triton_example_trace.json.gz"  # A100: 1 step, 1 Triton kernel
ALL = [ALEXNET, MI250, TRITON]


def raw(path) -> dict:
    return copy.deepcopy(traces.load_trace(path))


def hta_idle(path_or_trace, exact: bool) -> pd.Series:
    """HTA's idle time per (stream, category), in ms."""
    _, idle = traces.hta_breakdown(path_or_trace, exact=exact)
    return idle.set_index(["stream", "idle_category"])["idle_time"] / 1e3


def assert_idle_agrees(ours: pd.DataFrame, theirs: pd.Series):
    """Equal to HTA's idle time per stream and category, which HTA rounds to 0.01 µs."""
    ours = ours.set_index(["stream", "idle_category"])["idle_ms"]
    assert ours.reindex(theirs.index).to_numpy() == pytest.approx(theirs.to_numpy(), rel=0, abs=5.1e-6)
    assert ours.drop(theirs.index).eq(0).all()  # HTA leaves out the categories with no gap


def hta_temporal_ms(path_or_trace, exact: bool) -> dict:
    temporal, _ = traces.hta_breakdown(path_or_trace, exact=exact)
    row = temporal.iloc[0]
    return {"span_ms": row["kernel_time(us)"] / 1e3, "compute_ms": row["compute_time(us)"] / 1e3,
            "non_compute_ms": row["non_compute_time(us)"] / 1e3, "idle_ms": row["idle_time(us)"] / 1e3}


# ----- steps and busy time ---------------------------------------------------------------------------------


def test_steps_are_the_cpu_side_profiler_steps_not_their_gpu_side_copies():
    trace = raw(MI250)
    gpu_side = [e for e in trace["traceEvents"] if e.get("cat") == "gpu_user_annotation"
                and e["name"].startswith("ProfilerStep#")]
    assert len(gpu_side) == 1  # what made 2 steps come out as 3 windows
    windows = traces.steps(trace)
    assert list(windows["step"]) == [1, 2]
    assert windows["start_ms"].iloc[1] == pytest.approx(windows["end_ms"].iloc[0])
    assert windows["cpu_ms"].tolist() == pytest.approx([9.288291, 0.049073])
    assert len(traces.gpu_busy(trace)) == 2


def test_gpu_busy_of_a_real_trace_counts_kernels_copies_and_memsets_once_each():
    busy = traces.gpu_busy(MI250).set_index("step")
    assert busy.loc[1, "kernels"] == 14 and busy.loc[2, "kernels"] == 0  # step 2 launched nothing
    assert busy.loc[1, "kernel_ms"] == pytest.approx(0.110881)           # 14 kernels, none overlapping
    assert busy.loc[1, "memcpy_ms"] == pytest.approx(0.022441 + 0.015720)
    assert busy.loc[1, "busy_ms"] == pytest.approx(0.110881 + 0.038161)  # kernels and copies: the GPU was busy
    assert (busy["idle_ms"] == busy["step_ms"] - busy["busy_ms"]).all()
    assert busy.loc[1, "busy_share"] == pytest.approx(busy.loc[1, "busy_ms"] / busy.loc[1, "step_ms"])
    assert busy.loc[1, "kernel_share"] == pytest.approx(0.110881 / busy.loc[1, "step_ms"])


def test_gpu_busy_temporal_and_idle_breakdown_agree_with_each_other():
    """One stream, every GPU event inside the steps: the three views of the same trace give the same totals."""
    busy, temporal = traces.gpu_busy(MI250), traces.temporal_breakdown(MI250).iloc[0]
    assert busy["busy_ms"].sum() == pytest.approx(temporal["busy_ms"])
    assert busy["kernel_ms"].sum() == pytest.approx(temporal["compute_ms"])
    assert temporal["busy_ms"] == pytest.approx(temporal["compute_ms"] + temporal["non_compute_ms"])
    idle = traces.idle_breakdown(MI250)
    assert set(idle["stream"]) == {0} and idle["idle_ms"].sum() == pytest.approx(temporal["idle_ms"])
    assert temporal["span_ms"] == pytest.approx(temporal["busy_ms"] + temporal["idle_ms"])


# ----- HolisticTraceAnalysis itself, next to gpulab ---------------------------------------------------------


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name.split("_")[0] + "_" + p.name.split("_")[1])
def test_idle_breakdown_agrees_with_hta_exactly_and_with_its_rounding(path):
    assert_idle_agrees(traces.idle_breakdown(path), hta_idle(path, exact=True))
    assert_idle_agrees(traces.idle_breakdown(path, hta_rounding=True), hta_idle(path, exact=False))


def test_temporal_breakdown_agrees_with_hta_on_a_trace_with_steps_and_copies():
    ours = traces.temporal_breakdown(MI250).iloc[0]
    for exact, mine in ((True, ours), (False, traces.temporal_breakdown(MI250, hta_rounding=True).iloc[0])):
        theirs = hta_temporal_ms(MI250, exact=exact)
        assert {k: mine[k] for k in theirs} == pytest.approx(theirs, rel=1e-9, abs=1e-9)


def test_htas_rounding_is_the_whole_difference_and_lengthens_every_gap():
    """HTA rounds each event inward to whole µs by default: on this nanosecond trace its host wait is longer than
    the trace says, by at most 2 µs per gap; with its rounding off it gives gpulab's number."""
    exact, rounded = hta_idle(MI250, exact=True), hta_idle(MI250, exact=False)
    gaps = len(traces._device_activity(MI250)) - 1
    extra = rounded.sum() - exact.sum()
    assert 0 < extra <= 2e-3 * gaps
    assert exact.sum() == pytest.approx(traces.idle_breakdown(MI250)["idle_ms"].sum())
    assert hta_temporal_ms(MI250, exact=False)["compute_ms"] < traces.temporal_breakdown(MI250)["compute_ms"].iloc[0]


def test_where_htas_temporal_breakdown_differs_the_reason_is_shown_by_hta_itself():
    # A100 AlexNet: HTA counts the cuda_sync records (stream syncs, context syncs, stream waits) as GPU time.
    trace = raw(ALEXNET)
    ours = traces.temporal_breakdown(trace).iloc[0]
    theirs = hta_temporal_ms(trace, exact=True)
    assert theirs["span_ms"] > ours["span_ms"] and theirs["non_compute_ms"] > ours["non_compute_ms"]
    no_sync = {**trace, "traceEvents": [e for e in trace["traceEvents"] if e.get("cat") != "cuda_sync"]}
    assert {k: ours[k] for k in theirs} == pytest.approx(hta_temporal_ms(no_sync, exact=True), rel=1e-9)
    assert traces.temporal_breakdown(no_sync).equals(traces.temporal_breakdown(trace))
    # A100 Triton: HTA counts the CPU op that launches the kernel as GPU time (it carries a "stream" argument).
    trace = raw(TRITON)
    ours = traces.temporal_breakdown(trace).iloc[0]
    assert ours["compute_ms"] == pytest.approx(0.00176)  # the one kernel
    assert hta_temporal_ms(trace, exact=True)["compute_ms"] == pytest.approx(0.095812)  # the launcher's CPU time
    for event in trace["traceEvents"]:
        if event.get("cat") == "cpu_op":
            event.get("args", {}).pop("stream", None)
    assert {k: ours[k] for k in ("compute_ms", "span_ms")} == pytest.approx(
        {k: hta_temporal_ms(trace, exact=True)[k] for k in ("compute_ms", "span_ms")})


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # HTA's own use of pandas
def test_a_kernel_queued_after_the_profiled_steps_is_left_out_and_how_hta_differs(tmp_path):
    """A CUDA trace holds each step's range a second time on the GPU's rows, spanning the GPU work launched directly in
    the step, which can end after the CPU side of the step. A kernel queued after the last step (by code after the
    loop) while the GPU still runs the step's kernels is no part of the profiled steps: gpulab leaves it out,
    whichever copy of the step ends last. HTA 0.5 means to leave it out too, but keeps it: it compares each CPU
    event's start, shifted to the trace's start, with the last step's end, which it does not shift (its "end" column
    is computed before it aligns the trace), so with include_last_profiler_step=True nothing is ever left out."""
    trace = raw(MI250)
    step2 = next(e for e in trace["traceEvents"] if e.get("cat") == "user_annotation" and e["name"] == "ProfilerStep#2")
    cpu_end = step2["ts"] + step2["dur"]
    gpu_side = {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#2", "pid": 2, "tid": 0,
                "ts": step2["ts"] + 5, "dur": cpu_end + 100 - step2["ts"], "args": {"External id": 39}}
    late = [{"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": step2["pid"], "tid": step2["tid"],
             "ts": cpu_end + 10, "dur": 5, "args": {"correlation": 9001, "External id": 9001}},
            {"ph": "X", "cat": "kernel", "name": "late_kernel", "pid": 2, "tid": 0, "ts": cpu_end + 40, "dur": 30,
             "args": {"correlation": 9001, "stream": 0, "External id": 9001}}]
    with_late = {**trace, "traceEvents": trace["traceEvents"] + [gpu_side] + late}
    assert list(traces.steps(with_late)["step"]) == [1, 2]
    pd.testing.assert_frame_equal(traces.idle_breakdown(with_late), traces.idle_breakdown(MI250))
    pd.testing.assert_frame_equal(traces.temporal_breakdown(with_late), traces.temporal_breakdown(MI250))

    last_end = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("cat") in traces.GPU_CATEGORIES)
    gap_ms = (cpu_end + 40 - last_end) / 1e3  # the host wait before the late kernel, which HTA counts
    ours = traces.idle_breakdown(with_late)["idle_ms"].sum()
    assert hta_idle(with_late, exact=True).sum() == pytest.approx(ours + gap_ms, abs=1e-5)
    with gzip.open(tmp_path / "rank-0.json.gz", "wt") as f:
        json.dump(with_late, f)
    frame = TraceAnalysis(trace_dir=str(tmp_path), include_last_profiler_step=True).t.get_trace(0)
    assert frame["end"].max() > 1e12 > frame["ts"].max()  # "end" still counts from 1970, "ts" from the trace's start


# ----- CUDA runtime calls ---------------------------------------------------------------------------------


def test_runtime_calls_count_the_cuda_api_calls_of_a_real_trace():
    calls = traces.runtime_calls(ALEXNET).set_index("name")
    assert calls.loc["cudaLaunchKernel", "calls"] == 79
    assert calls.loc["cudaMalloc", "calls"] == 24 and calls.loc["cudaFree", "calls"] == 15
    assert calls["calls"].sum() == 361 and calls["calls"].is_monotonic_decreasing
    assert calls.loc["cudaMalloc", "mean_us"] == pytest.approx(calls.loc["cudaMalloc", "total_ms"] * 1e3 / 24)
    assert set(traces.runtime_calls(TRITON)["name"]) == {"cuLaunchKernel", "cudaDeviceSynchronize"}  # driver too
    assert traces.runtime_calls(MI250).set_index("name").loc["hipLaunchKernel", "calls"] == 12      # ROCm: HIP
    cpu_only = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]}
    assert traces.runtime_calls(cpu_only).empty and list(traces.runtime_calls(cpu_only).columns) == [
        "name", "calls", "total_ms", "mean_us"]


# ----- the operator tables of a profile with kernels in it -------------------------------------------------


def key_averages_of(path) -> EventList:
    """``prof.key_averages()`` of the profile that wrote this trace, rebuilt with torch's own classes the way
    torch.autograd.profiler builds it from Kineto's events on a GPU: CPU events (operators, ranges, runtime calls)
    with device_type CPU, GPU events (kernels, copies, and the GPU-side copy of each range) with device_type
    CUDA, each kernel appended to the CPU operator that launched it (matched by its External id)."""
    runtime, device = {"cuda_runtime", "cuda_driver"}, {"kernel", "gpu_memcpy", "gpu_memset"}
    cpu_cats, gpu_cats = {"cpu_op", "user_annotation", *runtime}, {*device, "gpu_user_annotation"}
    function_events, by_id = [], {}
    for e in traces.load_trace(path)["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in cpu_cats | gpu_cats:
            continue
        args, on_gpu = e.get("args", {}), e["cat"] in gpu_cats
        linked = args.get("External id", 0) if e["cat"] in device | runtime else 0
        fe = FunctionEvent(id=args.get("External id", 0), name=_rewrite_name(e["name"], with_wildcard=True),
                           thread=e["tid"], start_us=e["ts"], end_us=e["ts"] + e.get("dur", 0), use_device="cuda",
                           device_type=DeviceType.CUDA if on_gpu else DeviceType.CPU, input_shapes=[], stack=[],
                           is_user_annotation=e["cat"] in ("user_annotation", "gpu_user_annotation"),
                           linked_correlation_id=linked)
        function_events.append(fe)
        if not linked and not on_gpu:
            by_id[fe.id] = fe
    for fe in function_events:
        parent = by_id.get(fe.linked_correlation_id) if fe.linked_correlation_id else None
        if parent is not None and fe.device_type == DeviceType.CUDA:
            parent.append_kernel(fe.name, 0, fe.time_range.end - fe.time_range.start)
        elif parent is not None:
            fe.thread = parent.thread  # a runtime call runs on the thread of the operator that made it
    events_ = EventList(function_events, use_device="cuda")
    events_._build_tree()
    return events_.key_averages()


def test_op_table_holds_the_cpu_side_and_kernel_table_the_gpu_side_of_a_gpu_profile():
    averages = key_averages_of(MI250)
    assert {str(a.device_type) for a in averages} == {"DeviceType.CPU", "DeviceType.CUDA"}
    assert sum(a.key == "ProfilerStep*" for a in averages) == 2  # torch keeps the GPU-side copy as a second row

    table = traces.op_table(averages)
    ranges = table[table["operator"].isin(["ProfilerStep*", "Optimizer.step#SGD.step"])]
    ranges = ranges.set_index("operator")["cpu_total_ms"]
    assert isinstance(ranges["ProfilerStep*"], float)  # one number per range, as the lesson formats it
    assert ranges["ProfilerStep*"] == pytest.approx(9.288291 + 0.049073)
    gpu_ms = traces.temporal_breakdown(MI250)["busy_ms"].iloc[0]  # every kernel and copy, none overlapping
    # (the rebuilt events hold absolute timestamps of ~4e12 µs: their durations are exact to about 1 ns)
    assert table["self_device_ms"].sum() == pytest.approx(gpu_ms, abs=1e-5)  # each kernel counted once, not twice
    addmm = table.set_index("operator").loc["aten::addmm"]
    assert addmm["self_device_ms"] == pytest.approx(0.00688 + 0.0176, abs=1e-5)  # its two kernels
    assert addmm["calls"] == 1 and addmm["self_cpu_ms"] > 0

    assert set(table["device_type"]) == {"CPU"} and table["operator"].is_unique
    kinds = table.set_index("operator")["kind"]
    assert kinds["aten::addmm"] == "operator" and kinds["hipLaunchKernel"] == "runtime"
    assert kinds["ProfilerStep*"] == "range" and table.loc[table["kind"] == "range", "is_range"].all()

    kernels = traces.kernel_table(averages)
    assert set(kernels["device_type"]) == {"CUDA"} and set(kernels["kind"]) == {"kernel", "memcpy", "range"}
    assert (kernels["self_cpu_ms"] == 0).all()
    assert set(kernels.loc[kernels["is_range"], "operator"]) == {"ProfilerStep*", "Optimizer.step#SGD.step"}
    assert kernels.loc[~kernels["is_range"], "self_device_ms"].sum() == pytest.approx(gpu_ms, abs=1e-5)


def test_the_dominant_operator_of_a_gpu_profile_is_an_operator_not_a_kernel():
    gpu_names = {e["name"] for e in traces.load_trace(MI250)["traceEvents"] if e.get("cat") in traces.GPU_CATEGORIES}
    table = traces.op_table(key_averages_of(MI250))
    dominant = dominant_operator(table)
    assert dominant not in gpu_names and dominant.startswith("aten::")
    top = traces.top_ops(table, "self_device_ms", n=3)
    assert not set(top["operator"]) & gpu_names
    kernels = traces.kernel_table(key_averages_of(MI250))
    assert traces.top_ops(kernels, "self_device_ms", n=1)["kind"].iloc[0] in ("kernel", "memcpy")


def test_kernel_table_of_a_cpu_profile_says_there_are_no_kernels():
    cpu_only = [e for e in key_averages_of(MI250) if e.device_type == DeviceType.CPU]
    with pytest.raises(traces.NoDeviceEvents, match="recorded on a CPU"):
        traces.kernel_table(cpu_only)
