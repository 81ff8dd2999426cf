"""What lesson 06's own traces from a real H200 say (tests/data/lesson06/README.md): what limits a loop
(``traces.bottleneck``), and what the GPU side of a range spans (``traces.range_spans``). On that run the lesson
called a loop "fixed" whose GPU ran something 2 % of the time, and said each step's GPU side spanned its kernels."""

from pathlib import Path

import pandas as pd
import pytest

from gpulab import traces

DATA = Path(__file__).parent / "data" / "lesson06"
SLOW = DATA / "h200_slow_trace.json.gz"        # the slow loop, section 2
SIX_FIXES = DATA / "h200_six_fixes_trace.json.gz"  # the loop with section 6's six fixes


def synthetic_trace(kernels_us, step_us=1000.0, launches_early=False):
    """Two 1 ms steps on one stream; ``kernels_us``: (start, duration) of each kernel in µs from the first step's
    start, each launched by a cudaLaunchKernel 5 µs before it starts (or at time 0, queued ahead: ``launches_early``)."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
               "ts": (n - 1) * step_us, "dur": step_us - 1} for n in (1, 2)]
    for i, (start, duration) in enumerate(kernels_us):
        launch = 0.0 if launches_early else start - 5
        events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": launch,
                    "dur": 2, "args": {"correlation": i}},
                   {"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": start, "dur": duration,
                    "args": {"correlation": i, "stream": 7}}]
    return {"traceEvents": events}


# ----- what limits the steps -------------------------------------------------------------------------------


def test_the_six_fix_loop_on_the_h200_was_limited_by_the_cpu_not_the_gpu():
    found = traces.bottleneck(SIX_FIXES)
    busy = traces.gpu_busy(SIX_FIXES)
    assert found.bound == "CPU"
    assert found.busy_share == pytest.approx(busy["busy_ms"].sum() / busy["step_ms"].sum())
    assert found.busy_share == pytest.approx(0.0220, abs=5e-5)       # far from busy: what the lesson called fixed
    assert found.kernel_share == pytest.approx(busy["kernel_ms"].sum() / busy["step_ms"].sum())
    assert found.idle_causes["host_wait"] == pytest.approx(0.9577, abs=1e-4)
    assert sum(found.idle_causes.values()) == pytest.approx(1.0)
    said = str(found)
    assert said.startswith("the CPU is the bottleneck, not the GPU") and "2.2%" in said and "96% of its idle time" in said
    assert traces.bottleneck(SLOW).bound == "CPU" and f"{traces.bottleneck(SLOW).busy_share:.1%}" == "0.1%"


def test_a_gpu_busy_through_its_steps_is_the_bottleneck():
    trace = synthetic_trace([(10 + 100 * i, 99) for i in range(19)] + [(1910, 80)])  # kernels 1961 µs of 2000
    found = traces.bottleneck(trace)
    assert found.busy_share >= traces.GPU_BOUND_AT and found.bound == "GPU"
    assert str(found).startswith("the GPU is the bottleneck")
    assert traces.bottleneck(trace, busy_at_least=0.99).bound == "launch overhead"  # its 1 µs gaps: kernel wait


def test_short_gaps_between_kernels_queued_ahead_are_launch_overhead():
    trace = synthetic_trace([(10 + 40 * i, 20) for i in range(50)], launches_early=True)  # 20 µs gaps, all queued
    found = traces.bottleneck(trace)
    assert found.bound == "launch overhead" and found.idle_causes["kernel_wait"] == pytest.approx(1.0)
    assert "kernel wait" in str(found)
    late = synthetic_trace([(10 + 40 * i, 20) for i in range(50)])  # each launched after the stream ran dry
    assert traces.bottleneck(late).bound == "CPU"


def test_a_trace_without_kernels_has_no_bottleneck_to_read():
    with pytest.raises(traces.NoDeviceEvents, match="recorded on a CPU"):
        traces.bottleneck(synthetic_trace([]))


# ----- the GPU side of a range -----------------------------------------------------------------------------


def test_a_steps_gpu_side_holds_only_what_it_launched_outside_its_nested_ranges():
    """The H200 trace: ProfilerStep#2's GPU side lasts 1.8 µs and holds one copy (the loss read back by .item()),
    while the CPU launched 217 GPU events during the step; backward's holds one kernel of the 33 launched meanwhile
    (autograd launches the rest from its own thread); the optimizer range has no GPU side (its kernels are in the
    nested Optimizer.step range)."""
    spans = traces.range_spans(SLOW).set_index(["step", "name"])
    step = spans.loc[(2, "ProfilerStep#2")]
    assert step["cpu_ms"] == pytest.approx(415.48283)
    assert step["gpu_span_ms"] == pytest.approx(0.001826) and step["in_span"] == 1 and step["launched"] == 217
    backward = spans.loc[(2, "backward")]
    assert backward["gpu_span_ms"] == pytest.approx(0.000802) and backward["in_span"] == 1 and backward["launched"] == 33
    assert pd.isna(spans.loc[(2, "optimizer"), "gpu_span_ms"]) and spans.loc[(2, "optimizer"), "launched"] == 70
    assert spans.loc[(2, "Optimizer.step#Adam.step"), "in_span"] == 70
    assert spans.loc[(2, "forward"), "in_span"] == spans.loc[(2, "forward"), "launched"] == 15
    copy = [e for e in traces.load_trace(SLOW)["traceEvents"] if e.get("cat") == "gpu_memcpy"
            and abs(e["ts"] - 4890247006745.873) < 0.01]
    assert copy and copy[0]["name"].startswith("Memcpy DtoH")
    assert set(spans.index.get_level_values("step")) == {2, 3}


def test_the_gpu_side_of_every_step_is_microseconds_long_on_both_h200_traces():
    for path in (SLOW, SIX_FIXES):
        spans = traces.range_spans(path)
        steps = spans[spans["name"].str.startswith("ProfilerStep#")]
        assert len(steps) == 2 and (steps["gpu_span_ms"] < 0.002).all() and (steps["in_span"] == 1).all()
        assert (steps["launched"] > 100).all()


def test_range_spans_of_a_cpu_trace_say_there_is_no_gpu_side():
    cpu_only = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 5}]}
    with pytest.raises(traces.NoDeviceEvents, match="recorded on a CPU"):
        traces.range_spans(cpu_only)
