"""gpulab.traces on a real CPU profile and on a small hand-written GPU trace (Kineto's Chrome trace format), so that
the GPU-side code (busy/idle per step, timelines, HolisticTraceAnalysis, recording a reference trace) runs here too.
The same code on real GPU traces (A100, MI250): tests/test_traces_real_gpu.py."""

import gzip
import json
import sys

import matplotlib
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from gpulab import models, plots, traces

matplotlib.use("Agg")

# ----- a hand-written GPU trace ---------------------------------------------------------------------------

STEP_US = 1000
# Per step, relative to its start (µs): (CPU launch time, stream, kernel start, kernel duration).
KERNELS = [(20, 7, 100, 200), (40, 8, 150, 100), (60, 7, 300, 100), (300, 7, 600, 200)]
COPY = (5, 7, 420, 50)  # a host-to-device copy, after the second kernel on stream 7


def gpu_trace() -> dict:
    """Two training steps as torch.profiler + Kineto write them on a GPU: ProfilerStep and record_function ranges,
    CPU operators, cudaLaunchKernel / cudaMemcpyAsync calls, and the kernels and copy they launch (matched by
    ``correlation``) on streams 7 and 8. Per step the kernels cover 100-400 and 600-800 µs: 500 µs busy."""
    events, correlation = [], 0

    def add(name, cat, pid, tid, ts, dur, **args):
        events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                       "args": args})

    for step in (1, 2):
        t0 = step * STEP_US
        add(f"ProfilerStep#{step}", "user_annotation", 100, 100, t0, 900)
        add("forward", "user_annotation", 100, 100, t0 + 10, 400)
        add("backward", "user_annotation", 100, 100, t0 + 420, 300)
        for i, (launch, stream, start, dur) in enumerate([COPY, *KERNELS]):
            correlation += 1
            copy = i == 0
            add("aten::copy_" if copy else "aten::mm", "cpu_op", 100, 100, t0 + launch, 15,
                **{"External id": correlation})
            add("cudaMemcpyAsync" if copy else "cudaLaunchKernel", "cuda_runtime", 100, 100, t0 + launch + 2, 10,
                correlation=correlation, **{"External id": correlation})
            add("Memcpy HtoD (Pageable -> Device)" if copy else f"gemm_{i}", "gpu_memcpy" if copy else "kernel",
                0, stream, t0 + start, dur, stream=stream, device=0, correlation=correlation,
                **{"External id": correlation})
    events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}})
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "a hand-written GPU"}],
            "traceEvents": events}


@pytest.fixture
def gpu_trace_file(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(gpu_trace()))
    return path


# ----- a real CPU profile ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """Four steps of a small CNN on the CPU, steps 2 and 3 recorded with shapes and memory: (profile, trace path)."""
    path = tmp_path_factory.mktemp("traces") / "cpu.json"
    model = models.TutorialCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path)), record_shapes=True, profile_memory=True,
                 acc_events=True) as prof:
        for batch in (8, 8, 6, 8):
            with record_function("data"):
                x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
            prof.step()
    return prof, path


def test_op_table_of_a_real_profile(cpu_profile):
    prof, _ = cpu_profile
    table = traces.op_table(prof)
    rows = table.set_index("operator")
    assert set(traces.PHASES) <= set(rows.index) and rows.loc[list(traces.PHASES), "is_range"].all()
    assert rows.loc["forward", "calls"] == 2  # two recorded steps
    assert not rows.loc["aten::mkldnn_convolution", "is_range"]
    assert (table["self_cpu_ms"] >= 0).all() and (table["self_device_ms"] == 0).all()
    assert set(table["device_type"]) == {"CPU"} and set(table["kind"]) == {"operator", "range"}
    assert (table["kind"] == "range").equals(table["is_range"])
    with pytest.raises(traces.NoDeviceEvents, match="op_table.prof. has its CPU side"):
        traces.kernel_table(prof)
    assert rows.loc["forward", "cpu_total_ms"] >= rows.loc["forward", "self_cpu_ms"]
    by_shape = traces.op_table(prof, group_by_input_shape=True)
    assert len(by_shape) > len(table)
    shapes = by_shape.loc[by_shape["operator"] == "aten::mkldnn_convolution", "input_shapes"]
    assert any("[8, 3, 32, 32]" in s for s in shapes) and any("[6, 3, 32, 32]" in s for s in shapes)


def test_top_ops_sorts_leaves_out_ranges_and_says_when_there_is_no_device_time(cpu_profile):
    table = traces.op_table(cpu_profile[0])
    top = traces.top_ops(table, "self_cpu_ms", n=5)
    assert len(top) == 5 and not top["is_range"].any()
    assert top["self_cpu_ms"].is_monotonic_decreasing
    assert top["self_cpu_ms"].iloc[0] == table.loc[~table["is_range"], "self_cpu_ms"].max()
    assert traces.top_ops(table, "cpu_total_ms", n=1, ranges=True)["operator"].iloc[0].startswith("ProfilerStep")
    with pytest.raises(traces.NoDeviceEvents, match="recorded on a CPU"):
        traces.top_ops(table, "self_device_ms")
    with pytest.raises(traces.TraceError, match="self_cpu_ms"):
        traces.top_ops(table, "self_gpu_ms")
    with pytest.raises(traces.TraceError, match="only record_function ranges"):
        traces.top_ops(table[table["is_range"]], "self_cpu_ms")


def test_the_cpu_trace_gives_steps_phases_ranges_and_allocations(cpu_profile):
    _, path = cpu_profile
    trace = traces.load_trace(path)
    windows = traces.steps(trace)
    assert list(windows["step"]) == [2, 3]  # wait 1 + warmup 1: steps 2 and 3 are recorded
    assert (windows["end_ms"] > windows["start_ms"]).all()
    assert windows["start_ms"].iloc[1] == pytest.approx(windows["end_ms"].iloc[0])
    phases = traces.phase_times(trace)
    assert list(phases.columns) == ["step", *traces.PHASES, "other"]
    assert (phases[list(traces.PHASES)] > 0).all().all()
    total = phases[[*traces.PHASES, "other"]].sum(axis=1)
    assert total.to_numpy() == pytest.approx((windows["end_ms"] - windows["start_ms"]).to_numpy(), rel=1e-6)
    ops = traces.op_ranges(trace)
    assert set(ops.loc[ops["name"] == "aten::mkldnn_convolution", "range"]) == {"forward"}
    assert set(ops.loc[ops["name"] == "aten::convolution_backward", "range"]) <= {"backward", ""}
    assert len(traces.allocations(trace)) > 0 and set(traces.allocations(trace)["device"]) == {"cpu"}
    assert not traces.has_device_events(trace)
    spans = traces.timeline_spans(trace)
    assert set(spans["lane"]) == {"CPU thread 0"} and set(spans["kind"]) == set(traces.PHASES)


def test_gpu_busy_is_the_union_of_gpu_intervals_per_step(gpu_trace_file):
    busy = traces.gpu_busy(gpu_trace_file)
    assert list(busy["step"]) == [1, 2]
    assert busy["kernel_ms"].tolist() == pytest.approx([0.5, 0.5])  # the kernel on stream 8 overlaps: counted once
    assert busy["memcpy_ms"].tolist() == pytest.approx([0.05, 0.05])
    assert busy["busy_ms"].tolist() == pytest.approx([0.55, 0.55])  # the copy runs while no kernel does
    assert busy["step_ms"].tolist() == pytest.approx([1.0, 0.9])    # the last step ends with its CPU side
    assert busy["idle_ms"].tolist() == pytest.approx([0.45, 0.35])
    assert busy["busy_share"].tolist() == pytest.approx([0.55, 0.55 / 0.9])
    assert busy["kernel_share"].tolist() == pytest.approx([0.5, 0.5 / 0.9])
    assert busy["kernels"].tolist() == [4, 4] and busy["memset_ms"].eq(0).all()
    assert traces.has_device_events(gpu_trace_file)


def test_a_gpu_side_copy_of_a_step_is_not_a_step(gpu_trace_file):
    """On a GPU, Kineto writes each ProfilerStep#N a second time, on the GPU's row (gpu_user_annotation), over the
    GPU work launched directly in the step (outside its nested ranges; here made to span most of its kernels):
    still two steps, with the same busy time."""
    trace = gpu_trace()
    for step in (1, 2):
        t0 = step * STEP_US
        trace["traceEvents"].append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step}",
                                     "pid": 0, "tid": 7, "ts": t0 + 100, "dur": 700, "args": {"External id": step}})
    assert list(traces.steps(trace)["step"]) == [1, 2]
    pd.testing.assert_frame_equal(traces.gpu_busy(trace), traces.gpu_busy(gpu_trace_file))
    pd.testing.assert_frame_equal(traces.idle_breakdown(trace), traces.idle_breakdown(gpu_trace_file))


def test_the_last_step_lasts_until_its_last_kernel_ends():
    trace = gpu_trace()
    for event in trace["traceEvents"]:
        if event.get("name") == "gemm_4" and event["ts"] > 2 * STEP_US:
            event["dur"] = 500  # ends at 2000 + 600 + 500, after the CPU side (2900)
    busy = traces.gpu_busy(trace)
    assert busy["step_ms"].iloc[-1] == pytest.approx(1.1)
    assert busy["kernel_ms"].iloc[-1] == pytest.approx(0.3 + 0.5)


def test_busy_ms_counts_overlaps_once_and_clips_to_the_window():
    assert traces.busy_ms([(0, 4), (2, 6)], 0, 10) == pytest.approx(6)
    assert traces.busy_ms([(-2, 1), (9, 12)], 0, 10) == pytest.approx(2)
    assert traces.busy_ms([(5, 6), (1, 8), (2, 3)], 0, 10) == pytest.approx(7)
    assert traces.busy_ms([], 0, 10) == 0
    frame = pd.DataFrame({"start_ms": [12.0, 30.0], "end_ms": [15.0, 31.0]})
    assert traces.busy_ms(frame, 10, 20) == pytest.approx(3)


def test_timeline_spans_and_plots_of_a_gpu_trace(gpu_trace_file):
    spans = traces.timeline_spans(gpu_trace_file)
    assert set(spans["lane"]) == {"CPU thread 0", "GPU 0 stream 7", "GPU 0 stream 8"}
    assert set(spans.loc[spans["lane"] == "GPU 0 stream 7", "kind"]) == {"GPU kernel", "GPU memcpy"}
    assert len(spans[spans["kind"] == "GPU kernel"]) == 8
    ax = plots.trace_timeline(spans, steps=traces.steps(gpu_trace_file), title="hand-written")
    assert [t.get_text() for t in ax.texts if t.get_text().startswith("step")] == ["step 1", "step 2"]
    busy = traces.gpu_busy(gpu_trace_file)
    ax = plots.stacked(busy.assign(step=busy["step"].astype(str)), ["busy_ms", "idle_ms"], label="step")
    assert len(ax.patches) == 4
    table = pd.DataFrame({"operator": ["aten::mm", "aten::copy_"], "self_device_ms": [1.0, 0.1]})
    ax = plots.top_operators(table, "self_device_ms")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["aten::mm", "aten::copy_"]
    matplotlib.pyplot.close("all")


def test_bad_input_gets_one_clear_error(tmp_path, cpu_profile):
    with pytest.raises(traces.TraceError, match="export_chrome_trace"):
        traces.load_trace(tmp_path / "missing.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"traceEvents": [')
    with pytest.raises(traces.TraceError, match="not a readable trace"):
        traces.load_trace(corrupt)
    broken_gz = tmp_path / "broken.json.gz"
    broken_gz.write_bytes(b"not gzip")
    with pytest.raises(traces.TraceError, match="not a readable trace"):
        traces.load_trace(broken_gz)
    with pytest.raises(traces.TraceError, match="no 'traceEvents' list"):
        traces.load_trace({"events": []})
    with pytest.raises(traces.TraceError, match="holds no events"):
        traces.events({"traceEvents": []})
    with pytest.raises(traces.TraceError, match="prof.step()"):
        traces.steps({"traceEvents": [{"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 1}]})
    with pytest.raises(traces.TraceError, match="record_function"):
        traces.phase_times(gpu_trace(), phases=("data",))
    with pytest.raises(traces.TraceError, match="has not recorded anything"):
        traces.op_table(profile(activities=[ProfilerActivity.CPU]))
    with pytest.raises(traces.TraceError, match="needs a torch.profiler.profile"):
        traces.op_table("prof")
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=1)) as too_short:
        torch.ones(2).sum()
        too_short.step()  # one step: the schedule never reached its active step
    with pytest.raises(traces.TraceError, match="holds no events"):
        traces.op_table(too_short)
    with pytest.raises(traces.NoDeviceEvents, match="no GPU kernels"):
        traces.gpu_busy(cpu_profile[1])


def test_a_gz_trace_loads_like_the_json(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(gpu_trace(), f)
    pd.testing.assert_frame_equal(traces.gpu_busy(path), traces.gpu_busy(gpu_trace()))


# ----- HolisticTraceAnalysis ----------------------------------------------------------------------------

def test_hta_breakdown_agrees_with_gpulab_on_the_hand_written_trace(gpu_trace_file):
    ok, version = traces.hta_available()
    assert ok, version  # the course extra installs it
    temporal, idle = traces.hta_breakdown(gpu_trace_file)
    row = temporal.iloc[0]
    busy = traces.gpu_busy(gpu_trace_file)
    assert row["compute_time(us)"] == pytest.approx(busy["kernel_ms"].sum() * 1e3)        # kernels: 2 × 500 µs
    assert row["non_compute_time(us)"] == pytest.approx(busy["memcpy_ms"].sum() * 1e3)    # the copies: 2 × 50 µs
    assert busy["busy_ms"].sum() * 1e3 == pytest.approx(row["compute_time(us)"] + row["non_compute_time(us)"])
    ours = traces.temporal_breakdown(gpu_trace_file).iloc[0]
    assert ours["compute_ms"] * 1e3 == pytest.approx(row["compute_time(us)"])
    assert ours["non_compute_ms"] * 1e3 == pytest.approx(row["non_compute_time(us)"])
    assert ours["idle_ms"] * 1e3 == pytest.approx(row["idle_time(us)"])
    span = (2 * STEP_US + 800) - (STEP_US + 100)                                          # first kernel to last
    assert row["kernel_time(us)"] == pytest.approx(span)
    assert row["idle_time(us)"] == pytest.approx(span - 1000 - 100)
    assert set(idle["idle_category"]) == {"host_wait", "kernel_wait", "other"}
    assert set(idle["stream"]) == {7, 8}
    host_wait = idle.loc[idle["idle_category"] == "host_wait", "idle_time"].sum()
    assert host_wait > 0  # the last kernel of each step is launched (300 µs) after stream 7 ran dry (at 470 µs)


def test_gpulabs_idle_breakdown_classifies_idle_time_as_hta_does(gpu_trace_file):
    ours = traces.idle_breakdown(gpu_trace_file).set_index(["stream", "idle_category"])["idle_ms"]
    _, hta_idle = traces.hta_breakdown(gpu_trace_file)
    theirs = hta_idle.set_index(["stream", "idle_category"])["idle_time"] / 1e3
    assert ours.reindex(theirs.index).to_numpy() == pytest.approx(theirs.to_numpy())
    assert ours.drop(theirs.index).eq(0).all()  # HTA leaves out categories with no gaps
    # Stream 7, per step: the copy starts 20 µs after a kernel it was queued behind (kernel wait), the last kernel
    # 130 µs after the copy although it was queued before (other); step 2's first kernel was launched after the
    # stream ran dry (host wait, 300 µs). Stream 8 runs one kernel per step, launched after its last one ended.
    expected = {(7, "host_wait"): 0.3, (7, "kernel_wait"): 0.04, (7, "other"): 0.26, (8, "host_wait"): 0.9}
    assert {k: v for k, v in ours.items() if v} == pytest.approx(expected)
    late = gpu_trace()  # a kernel launched after the last profiled step ended: left out, as HTA does
    late["traceEvents"] += [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100, "ts": 3100, "dur": 5,
         "args": {"correlation": 999}},
        {"ph": "X", "cat": "kernel", "name": "late", "pid": 0, "tid": 7, "ts": 3200, "dur": 10,
         "args": {"correlation": 999, "stream": 7}}]
    pd.testing.assert_frame_equal(traces.idle_breakdown(late), traces.idle_breakdown(gpu_trace_file))
    wider = traces.idle_breakdown(gpu_trace_file, kernel_wait_us=200).set_index(["stream", "idle_category"])["idle_ms"]
    assert wider[(7, "kernel_wait")] == pytest.approx(0.3) and wider[(7, "other")] == 0


def test_hta_and_idle_breakdown_refuse_a_cpu_trace_with_a_clear_message(cpu_profile):
    with pytest.raises(traces.NoDeviceEvents, match="HolisticTraceAnalysis needs GPU kernels"):
        traces.hta_breakdown(cpu_profile[1])
    with pytest.raises(traces.NoDeviceEvents, match="needs a trace recorded on a GPU"):
        traces.idle_breakdown(cpu_profile[1])


def test_without_hta_the_helpers_say_what_to_install(gpu_trace_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "hta", None)  # as if it were not installed
    assert traces.hta_available() == (False, "HolisticTraceAnalysis is not installed: pip install holistictraceanalysis")
    with pytest.raises(traces.TraceError, match="pip install holistictraceanalysis"):
        traces.hta_breakdown(gpu_trace_file)
    assert len(traces.idle_breakdown(gpu_trace_file)) == 6  # gpulab's own classification needs no HTA


def test_an_hta_failure_is_one_clear_error(gpu_trace_file, monkeypatch):
    import hta.trace_analysis

    def broken(*args, **kwargs):
        raise KeyError("ts")

    monkeypatch.setattr(hta.trace_analysis, "TraceAnalysis", broken)
    with pytest.raises(traces.TraceError, match="could not analyse this trace .KeyError.*idle_breakdown"):
        traces.hta_breakdown(gpu_trace_file)


# ----- recording and shipping a GPU trace -----------------------------------------------------------------

def test_record_ships_a_slim_gpu_trace_with_provenance(gpu_trace_file, tmp_path, monkeypatch):
    monkeypatch.setattr(traces, "quick_mode", lambda: False)
    shipped = traces.record(gpu_trace_file, command="a test", target_dir=tmp_path / "reference")
    assert shipped == tmp_path / "reference" / "06_trace.json.gz"
    trace = traces.load_trace(shipped)
    assert trace["gpulab"]["command"] == "a test" and trace["gpulab"]["torch"] == torch.__version__
    assert trace["gpulab"]["device_name"] and trace["gpulab"]["recorded_at"]
    assert not any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])  # slimmed: no CPU operators
    pd.testing.assert_frame_equal(traces.gpu_busy(trace), traces.gpu_busy(gpu_trace_file))
    assert traces.hta_breakdown(trace)[0]["compute_time(us)"].iloc[0] == pytest.approx(1000)

    monkeypatch.setattr(traces, "REFERENCE_DIR", tmp_path / "reference")
    loaded, provenance = traces.reference_trace()
    assert loaded["traceEvents"] == trace["traceEvents"] and provenance["command"] == "a test"


def test_record_refuses_cpu_and_quick_traces(gpu_trace_file, cpu_profile, tmp_path, monkeypatch):
    monkeypatch.setattr(traces, "quick_mode", lambda: True)
    with pytest.raises(traces.TraceError, match="quick-mode run"):
        traces.record(gpu_trace_file, target_dir=tmp_path / "out")
    monkeypatch.setattr(traces, "quick_mode", lambda: False)
    with pytest.raises(traces.NoDeviceEvents, match="only a trace recorded on a GPU"):
        traces.record(cpu_profile[1], target_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_reference_trace_says_when_none_ships_and_refuses_one_without_provenance(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(traces, "REFERENCE_DIR", tmp_path)
    assert traces.reference_trace() == (None, {})
    assert "No reference trace '06_trace' ships" in capsys.readouterr().out
    (tmp_path / "06_trace.json").write_text(json.dumps(gpu_trace()))
    with pytest.raises(traces.TraceError, match="carries no provenance"):
        traces.reference_trace()


# ----- a real GPU trace ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_a_real_gpu_profile_through_every_helper(tmp_path):
    """On a GPU: kernels in the table and the trace, busy time per step within the step, HTA and gpulab's idle
    classification agree on a trace torch itself wrote."""
    path = tmp_path / "gpu.json"
    model = models.TutorialCNN(width=4).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path)), acc_events=True) as prof:
        for _ in range(5):
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
            loss.item()  # the CPU waits for the GPU: host-wait gaps at every step start
            prof.step()
    table, kernels = traces.op_table(prof), traces.kernel_table(prof)
    assert set(table["device_type"]) == {"CPU"} and table["operator"].is_unique
    assert set(kernels["device_type"]) == {"CUDA"} and "kernel" in set(kernels["kind"])
    assert table["self_device_ms"].sum() == pytest.approx(
        kernels.loc[~kernels["is_range"], "self_device_ms"].sum(), rel=1e-3)  # each kernel once
    top = traces.top_ops(table, "self_device_ms", n=3)
    assert (top["self_device_ms"] > 0).all() and top["operator"].str.startswith("aten::").all()
    busy = traces.gpu_busy(path)
    assert len(busy) == 3 and (busy["kernels"] > 0).all()
    assert ((busy["kernel_ms"] > 0) & (busy["kernel_ms"] <= busy["busy_ms"]) & (busy["busy_ms"] <= busy["step_ms"])).all()
    assert {"GPU kernel"} <= set(traces.timeline_spans(path)["kind"])
    assert traces.runtime_calls(path).set_index("name").loc["cudaLaunchKernel", "calls"] > 0
    temporal, hta_idle = traces.hta_breakdown(path, exact=True)
    ours = traces.temporal_breakdown(path).iloc[0]
    assert temporal["compute_time(us)"].iloc[0] == pytest.approx(ours["compute_ms"] * 1e3, abs=0.01)
    ours = traces.idle_breakdown(path).set_index(["stream", "idle_category"])["idle_ms"]
    theirs = hta_idle.set_index(["stream", "idle_category"])["idle_time"] / 1e3
    assert ours.reindex(theirs.index).to_numpy() == pytest.approx(theirs.to_numpy(), abs=1e-5)
    rounded = traces.idle_breakdown(path, hta_rounding=True).set_index(["stream", "idle_category"])["idle_ms"]
    theirs = traces.hta_breakdown(path)[1].set_index(["stream", "idle_category"])["idle_time"] / 1e3
    assert rounded.reindex(theirs.index).to_numpy() == pytest.approx(theirs.to_numpy(), abs=1e-5)


@pytest.mark.parametrize("event, says", [({"ts": "soon"}, "ts='soon', not a number"), ({"ts": 1.0, "dur": None},
                                                                                       "dur=None, not a number")])
def test_an_event_with_a_time_that_is_not_a_number_is_named(tmp_path, event, says):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 1,
                                                 "dur": 2.0, **event}]}))
    with pytest.raises(traces.TraceError, match=says):
        traces.events(path)
