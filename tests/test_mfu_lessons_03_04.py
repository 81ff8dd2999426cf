"""Lessons 03 and 04 report MFU beside samples/s and step time as the field defines it: a training step's FLOPs,
counted once with FlopCounterMode, over the vendor's dense datasheet peak of the precision that step ran in, never
another precision's; "of achievable", over the ceiling measured here in that precision, beside it; steps of different
precisions on one chart over one reference peak; no MFU without a vendor peak (a CPU), where the share of the measured
ceiling is shown and named as such; and a figure above 100 % never shown as a result.

The lessons' own code cells run here on the CPU, with fake ceilings far apart (so that dividing by the wrong one
cannot pass), fake timings where a cell times (for lesson 03, the step times and ceilings its H200 run measured), and,
where it matters, a GPU with TF32 standing in for the CPU in ``flops.precision_of``. Nothing is asserted on a real
timing."""

import dataclasses
import math
import re
import types

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import Comparison, batching, datasheets, flops
from gpulab.conditions import Conditions
from gpulab.results import caveats
from gpulab.timing import Measurement

from .conftest import ROOT

CEILINGS_TFLOPS = {"fp32": 1.0, "tf32": 8.0, "fp16": 64.0, "bf16": 32.0}  # fake, and far apart
CPU = torch.device("cpu")


def code(lesson: str, marker: str) -> str:
    """The source of the one code cell of a lesson that contains ``marker``."""
    path = next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb"))
    found = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, f"lesson {lesson}: {len(found)} code cells contain {marker!r}"
    return found[0]


def run(scope: dict, lesson: str, *markers: str) -> dict:
    """Run the lesson's cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
    scope.setdefault("__name__", "__main__")
    for marker in markers:
        exec(compile(code(lesson, marker), f"<lesson {lesson}: {marker}>", "exec"), scope)
    return scope


def reference_columns(name: str) -> set:
    return set(pd.read_csv(ROOT / "gpulab" / "reference" / f"{name}.csv", nrows=1).columns)


@pytest.fixture
def lesson_env(monkeypatch, results_dir):
    """Quick mode, results in a temporary folder, no figure shown, TF32 restored afterwards."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    yield results_dir
    torch.set_float32_matmul_precision(before)
    plt.close("all")


@pytest.fixture
def fake_ceilings(monkeypatch):
    """flops.ceilings answers with the fake ceilings; the list records which precisions a lesson asked for."""
    asked = []

    def ceilings(precisions=None, device=None, **options):
        asked.extend(precisions)
        return {p: flops.Ceiling(p, CEILINGS_TFLOPS[p]) for p in precisions}

    monkeypatch.setattr(flops, "ceilings", ceilings)
    return asked


@pytest.fixture
def tf32_gpu(monkeypatch):
    """flops.precision_of sees a GPU with TF32 (compute capability 8.0 or later); the work still runs on the CPU."""
    monkeypatch.setattr(flops, "device_info", lambda device: types.SimpleNamespace(tf32=True))


def fake_timing(monkeypatch, bench_s, compare_s=None):
    """gpulab.bench answers ``bench_s(label)`` seconds per call; gpulab.compare runs each side once, then answers
    five pairs of ``compare_s(label)`` seconds."""

    def bench(fn, *args, label=None, **kwargs):
        return Measurement(label, (bench_s(label),) * 3, "cpu", 1)

    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        seconds = compare_s or bench_s
        return Comparison.of([seconds(labels[0])] * 5, [seconds(labels[1])] * 5, labels=labels)

    monkeypatch.setattr(gpulab, "bench", bench)
    monkeypatch.setattr(gpulab, "compare", compare)


# ---- lesson 03 --------------------------------------------------------------------------------------------------
# Each model's step over the dense datasheet peak of the precision it ran in (MFU), "of achievable" over the ceiling
# measured here beside it, both models on one chart over one reference peak; on a CPU no MFU, and the share of the
# measured ceiling named as such; a figure above 100 % never shown, nor one of a launch-bound step (its time the
# launches', not the arithmetic's). MFU is the sweep's only: accumulation and the convergence runs compare speeds and
# losses. The GPU path replays what the lesson measured on an H200
# (tests/data/lesson03/): its step times and ceilings, whose "mfu" column then was the share of the ceiling.

LESSON03_DATA = ROOT / "tests" / "data" / "lesson03"
H200 = {name: pd.read_csv(LESSON03_DATA / f"h200_03_{name}.csv") for name in ("throughput", "accumulation", "convergence")}
H200_CEILINGS = dict(zip(H200["throughput"]["ceiling_precision"], H200["throughput"]["ceiling_tflops"]))  # tf32, fp32
H200_SHEET = datasheets.find("NVIDIA H200").tflops  # the H200's dense datasheet peaks
PERCENT = re.compile(r"(\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?) ?%")
LESSON03_START = ("plans.lesson(", "from gpulab import batch_finder")  # the plan, then the imports


def lesson03(monkeypatch):
    """Lesson 03 up to its MFU cell: the plan, the imports, the two models, the FLOPs counted and the ceilings."""
    return run({"gpulab": gpulab, "device": CPU}, "03", *LESSON03_START, "MODELS = {",
               "utilisation = batching.Utilisation(")


def of_fake_ceiling(flops_per_unit, units_per_s, precision):
    return flops_per_unit * units_per_s / (CEILINGS_TFLOPS[precision] * 1e12)


def h200_ceilings(monkeypatch):
    """flops.ceiling and flops.ceilings answer as on the H200 of 2026-11-27: its measured ceilings with their dense
    datasheet peaks."""

    def ceiling(precision, device=None, **options):
        return flops.Ceiling(precision, H200_CEILINGS[precision], device_name="NVIDIA H200",
                             datasheet_tflops=H200_SHEET[precision])

    monkeypatch.setattr(flops, "ceiling", ceiling)
    monkeypatch.setattr(flops, "ceilings", lambda precisions=None, device=None, **options: {p: ceiling(p) for p in precisions})


@pytest.fixture
def h200(monkeypatch, tf32_gpu):
    """The H200 of 2026-11-27: its ceilings (h200_ceilings), and flops.reference_peak as on a GPU: the fastest
    datasheet peak asked for."""
    h200_ceilings(monkeypatch)
    monkeypatch.setattr(flops, "reference_peak", lambda precisions, device=None: max(
        ((p, H200_SHEET[p]) for p in precisions), key=lambda pair: pair[1]))


@pytest.fixture
def busy_cpu(monkeypatch):
    """A CPU whose fp32 ceiling was measured while it was busy (issue 28: 0.0021 TFLOP/s). Asked again (again=True, as
    flops.mfu asks when a step beats it), flops.ceiling keeps the better of it and ``state.again``, in flops' own record
    of the best ceiling, as the real one does; ``state.asked_again`` counts those calls."""
    key = ("fp32", "cpu", (), 0.01)
    state = types.SimpleNamespace(again=None, asked_again=0)
    monkeypatch.setattr(flops, "_MEASURED", {key: flops.Ceiling("fp32", 0.0021, key=key)})
    monkeypatch.setattr(flops, "_AGAIN", set())

    def ceiling(precision, device=None, *, shapes=None, seconds=None, again=False):
        if again:
            state.asked_again += 1
            flops._MEASURED[key] = max(flops._MEASURED[key], flops.Ceiling("fp32", state.again, key=key), key=float)
        return flops._MEASURED[key]

    monkeypatch.setattr(flops, "ceiling", ceiling)
    monkeypatch.setattr(flops, "ceilings", lambda precisions=None, device=None, **options: {p: ceiling(p) for p in precisions})
    return state


def replay(monkeypatch, rows):
    """gpulab.bench answers the median seconds of ``rows`` (results a lesson wrote), one row after the other, in the
    lesson's order; gpulab.compare runs each side once and answers five pairs of 10 ms."""
    timings = iter(zip(rows["label"], rows["median_s"]))

    def bench_s(label):
        expected, seconds = next(timings)
        assert label == expected
        return seconds

    fake_timing(monkeypatch, bench_s, compare_s=lambda label: 0.01)


def shown_percentages(printed: str) -> list[float]:
    return [float(number.replace(",", "")) for number in PERCENT.findall(printed)]


def test_lesson_03_counts_each_models_training_flops_once(lesson_env, fake_ceilings, monkeypatch):
    scope = lesson03(monkeypatch)
    per_sample, precision = scope["utilisation"].work["WideMLP"]
    # WideMLP(width=1024): 3072 → 1024 → 1024 → 1024 → 10. Forward and weight gradients: 2 FLOPs per weight each;
    # input gradients for every layer but the first (the images need none).
    weights = [3072 * 1024, 1024 * 1024, 1024 * 1024, 1024 * 10]
    assert per_sample == 2 * sum(weights) * 2 + 2 * sum(weights[1:])
    assert scope["utilisation"].work["SmallCNN"][0] > 0
    assert fake_ceilings == ["fp32"] and precision == "fp32"  # on a CPU: fp32 only, measured once


def test_lesson_03_divides_convolutions_by_tf32_peaks_and_fp32_matmuls_by_fp32_peaks_on_a_tf32_gpu(
        lesson_env, h200, monkeypatch, capsys):
    scope = lesson03(monkeypatch)
    utilisation = scope["utilisation"]
    assert {name: p for name, (_, p) in utilisation.work.items()} == {"SmallCNN": "tf32", "WideMLP": "fp32"}
    assert "no vendor" not in capsys.readouterr().out
    for name, (per_sample, p) in utilisation.work.items():
        u = utilisation(name, 1000.0)
        assert (u.precision, u.datasheet_tflops, u.ceiling_tflops) == (p, H200_SHEET[p], H200_CEILINGS[p])
        assert u.mfu == pytest.approx(per_sample * 1000.0 / (H200_SHEET[p] * 1e12))  # the field's MFU
        assert u.of_achievable == pytest.approx(per_sample * 1000.0 / (H200_CEILINGS[p] * 1e12))
    # The precision follows the switch: TF32 on for matmuls puts the MLP under the TF32 peaks too.
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    for setting, expected in (("high", "tf32"), ("highest", "fp32")):
        torch.set_float32_matmul_precision(setting)
        utilisation.count("WideMLP", scope["MODELS"]["WideMLP"](), x, y, torch.nn.functional.cross_entropy)
        assert utilisation.work["WideMLP"][1] == expected


def test_lesson_03s_sweep_on_the_h200_records_mfu_over_the_dense_peak_and_shows_none_for_its_launch_bound_steps(
        lesson_env, h200, monkeypatch, capsys):
    """The H200's quick sweep (2026-11-27): every step 1.0-5.6 ms, as long at batch 128 as at batch 8: launch-bound.
    The log keeps each step's MFU over the dense peak of its precision; the lesson shows none of them (issue 39 item
    7: MFU is for steps whose time the arithmetic sets), and says why, a line a model."""
    measured = H200["throughput"]  # its "mfu" was the step over the ceiling measured on the H200: of achievable now
    replay(monkeypatch, measured)
    scope = lesson03(monkeypatch)
    capsys.readouterr()
    run(scope, "03", 'ResultLog("03_throughput")')
    written, curve = scope["log"].frame(), scope["curve"]
    assert written["flops_per_sample"].tolist() == measured["flops_per_sample"].tolist()  # the FLOPs the H200 counted
    for row, then in zip(written.itertuples(), measured.itertuples()):
        p = then.ceiling_precision
        assert (row.model, row.batch_size, row.ceiling_precision) == (then.model, then.batch_size, p)
        assert row.samples_per_s == pytest.approx(then.samples_per_s)
        assert row.of_achievable == pytest.approx(then.mfu)
        assert row.mfu == pytest.approx(then.mfu * H200_CEILINGS[p] / H200_SHEET[p])  # over the dense datasheet peak
        assert (row.datasheet_tflops, row.ceiling_tflops) == (H200_SHEET[p], H200_CEILINGS[p])
    assert (curve["mfu_warning"] == "").all()  # no figure above 100 %: the shares are left out for another reason
    assert curve["launch_bound"].all() and curve["mfu"].isna().all() and curve["of_achievable"].isna().all()
    printed = capsys.readouterr().out
    for name in ("SmallCNN", "WideMLP"):
        assert f"{name}: no MFU up to batch 128: launch-bound there" in printed

    run(scope, "03", "def knee(")
    assert all(math.isnan(y) for line in scope["axes"][0, 1].get_lines() for y in line.get_ydata())  # no point drawn
    printed = capsys.readouterr().out
    assert printed.count("(the knee): no MFU (launch-bound)") == 2 and not re.search(r"MFU \d", printed)


def test_lesson_03s_sweep_on_the_h200_shows_mfu_over_the_dense_peak_where_the_step_grows_with_the_batch(
        lesson_env, h200, monkeypatch, capsys):
    """The H200's quick sweep with steps that grow with the batch from batch 32 on (injected: its time times b/16):
    those rows show MFU over the dense peak of their precision and of achievable, both models on one chart over one
    reference peak; the rows below stay launch-bound."""
    measured = H200["throughput"]
    grown = measured.assign(median_s=measured["median_s"] * (measured["batch_size"] / 16).clip(lower=1))
    replay(monkeypatch, grown)
    scope = lesson03(monkeypatch)
    run(scope, "03", 'ResultLog("03_throughput")')
    curve = scope["curve"]
    assert curve["launch_bound"].tolist() == (curve["batch_size"] < 32).tolist()
    for row in curve[~curve["launch_bound"]].itertuples():
        p = row.ceiling_precision
        achieved = row.flops_per_sample * row.samples_per_s / 1e12
        assert (row.mfu, row.of_achievable) == pytest.approx((achieved / H200_SHEET[p], achieved / H200_CEILINGS[p]))

    capsys.readouterr()
    run(scope, "03", "def knee(")
    chart = scope["axes"][0, 1]  # both models on one axis: each over the one reference peak, the dense TF32 one
    assert chart.get_ylabel() == "MFU against the dense tf32 peak" and f"{H200_SHEET['tf32']:.4g}" in chart.get_title()
    for line in chart.get_lines():
        model = curve[curve["model"] == line.get_label()]
        expected = (model["achieved_tflops"] / H200_SHEET["tf32"]).where(~model["launch_bound"])
        assert [y for y in line.get_ydata() if not math.isnan(y)] == pytest.approx(expected.dropna().tolist())
    printed = capsys.readouterr().out
    for row in curve.groupby("model").tail(1).itertuples():  # each model's largest batch, beside its precision's peak
        assert (f": MFU {flops.percent(row.mfu)} of the dense {row.ceiling_precision} peak ({row.datasheet_tflops:g} "
                f"TFLOP/s; {flops.percent(row.of_achievable)} of achievable).") in printed
    assert "over the measured" not in printed


def test_mfu_is_shown_from_where_the_h100s_steps_grow_with_the_batch_not_for_its_launch_bound_ones():
    """The H100's shipped sweep: SmallCNN's step flat at 3.1-3.6 ms from batch 8 to 256 and 6.2 ms at 512; WideMLP's
    at 1.7-2.3 ms to batch 256. MFU from SmallCNN's batch 1024 (11.3 ms) and WideMLP's 512 (3.5 ms) on, at and
    below each knee (1024 and 2048); a slow step amid launch-bound ones (noise) shows none."""
    rows = gpulab.reference("03_throughput").assign(mfu=0.01, of_achievable=0.02)
    curve = batching.where_mfu_means_something(rows)
    for name, first in (("SmallCNN", 1024), ("WideMLP", 512)):
        model = curve[curve["model"] == name]
        assert model["launch_bound"].tolist() == (model["batch_size"] < first).tolist()
        assert model["mfu"].notna().tolist() == (model["batch_size"] >= first).tolist()
    noisy = rows.assign(median_s=rows["median_s"].where(rows["batch_size"] != 32, 0.02))  # 20 ms at batch 32
    assert batching.launch_bound(noisy).tolist() == batching.launch_bound(rows).tolist()


def test_lesson_03s_sweep_writes_the_tensors_peak_under_its_own_name(lesson_env, h200, monkeypatch):
    replay(monkeypatch, H200["throughput"])
    scope = lesson03(monkeypatch)
    run(scope, "03", 'ResultLog("03_throughput")')
    written = scope["log"].frame()
    # the shipped H100 rows' peak_MiB is the caching allocator's peak; this lesson counts tensors, under another name
    assert "tensors_peak_MiB" in written and "peak_MiB" not in written
    assert reference_columns("03_throughput") - {"peak_MiB"} <= set(written.columns)  # nothing else renamed
    assert (written["tensors_peak_MiB"] > 0).all()


def test_lesson_03s_accumulation_on_the_h200_says_its_speed_and_memory_and_no_mfu(lesson_env, h200, monkeypatch,
                                                                                 capsys):
    """A toy CNN's accumulation compares one batch with micro-batches: samples/s, memory and the speed-up in
    interleaved pairs; an MFU of thousandths of a percent there would mean nothing (issue 39, item 7)."""
    measured = H200["accumulation"]
    replay(monkeypatch, measured)
    scope = lesson03(monkeypatch)
    scope["timing"] = {}  # the sweep's timing arguments: the timings here are the H200's
    capsys.readouterr()
    run(scope, "03", "def make_accumulation_step(")
    accumulation = scope["accumulation"]
    assert accumulation["samples_per_s"].tolist() == pytest.approx((64 / measured["median_s"]).tolist())
    assert not {"mfu", "of_achievable"} & set(scope["accumulation_log"].frame().columns)
    printed = capsys.readouterr().out
    assert "Accumulating 4 micro-batches of 16 instead of one batch of 64" in printed and "MFU" not in printed


def h200_training(batch_size, lr, seconds, evals=8):
    """The training history the H200 run recorded for that batch size and learning rate."""
    history = H200["convergence"]
    rows = history[(history["batch_size"] == batch_size) & ((history["lr"] - lr).abs() < 1e-9)]
    return rows[["seconds", "samples", "steps", "test_loss"]].to_dict("records")


def test_lesson_03s_convergence_on_the_h200_names_test_losses_as_losses_and_counts_the_updates_it_compares(
        lesson_env, h200, monkeypatch, capsys):
    """The H200's runs (2026-11-27): the scaled and unscaled batch 4096 reached test losses of 0.338 and 1.037, which
    the lesson printed as what "the learning rate ... reached"; and batch 4096 made more updates (679) than batch 1024
    (623), where the lesson said it made up for "making fewer updates". Loss per second, not MFU, is what it compares."""
    fake_timing(monkeypatch, lambda label: 0.01)  # steps of 1024 and 4096 alike: 4x the samples per second
    scope = lesson03(monkeypatch)
    run(scope, "03", "def train_for(")
    scope["train_for"] = h200_training
    capsys.readouterr()
    run(scope, "03", 'ResultLog("03_convergence")')
    out = capsys.readouterr().out
    assert ("At batch 4096, training with the learning rate scaled by the rule (lr 1.02) reached a test loss of 0.338; "
            "with the base learning rate, unscaled (lr 0.004), 1.037.") in out
    assert "the lowest test loss came from batch 4096, lr 1.02 (test loss 0.338, " in out
    assert "made 679 updates in its 1 s, where batch 1024, lr 0.256 made 623" in out and "fewer updates" not in out
    assert "MFU" not in out and "mfu" not in scope["convergence"]


def test_lesson_03_on_a_cpu_says_mfu_needs_a_vendor_peak_and_shows_the_share_of_the_measured_ceiling(
        lesson_env, cpu_ceilings, monkeypatch, capsys):
    def bench_s(label):  # b=8: 8 ms
        return int(label.split("=")[1]) * 1e-3

    fake_timing(monkeypatch, bench_s, compare_s=lambda label: 0.01)
    scope = lesson03(monkeypatch)
    assert "no vendor fp32 peak for" in capsys.readouterr().out
    run(scope, "03", 'ResultLog("03_throughput")', "def knee(")
    curve = scope["curve"]
    assert curve["launch_bound"].tolist() == (curve["batch_size"] == 4).tolist()  # 4 ms, then 8 ms: twice it
    for row in curve[~curve["launch_bound"]].itertuples():
        per_sample = scope["utilisation"].work[row.model][0]
        assert math.isnan(row.mfu) and row.of_achievable == pytest.approx(of_fake_ceiling(per_sample, 1000.0, "fp32"))
    chart = scope["axes"][0, 1]
    assert chart.get_ylabel() == "share of the measured fp32 ceiling"
    for line in chart.get_lines():  # on a CPU one peak is the ceiling measured here
        model = curve[curve["model"] == line.get_label()]
        assert [y for y in line.get_ydata() if not math.isnan(y)] == pytest.approx(model["of_achievable"].dropna().tolist())
    printed = capsys.readouterr().out
    share = flops.percent(curve["of_achievable"].iloc[-1])
    assert f"batch {curve['batch_size'].iloc[-1]}" in printed and f": {share} of the measured fp32 ceiling" in printed
    assert not re.search(r"MFU \d", printed)  # no MFU without a vendor peak


def test_lesson_03_divides_every_step_by_the_best_ceiling_measured_so_far(lesson_env, busy_cpu, monkeypatch):
    busy_cpu.again = 1.0  # measured again on a quiet machine

    def bench_s(label):  # the first step beats the busy ceiling; the others are slower than it
        batch_size = int(label.split("=")[1])
        return 1e-3 if batch_size == 4 else batch_size * 1e-1

    fake_timing(monkeypatch, bench_s)
    scope = lesson03(monkeypatch)
    run(scope, "03", 'ResultLog("03_throughput")')
    curve = scope["curve"]
    assert busy_cpu.asked_again == 1
    assert (curve["ceiling_tflops"] == 1.0).all() and (curve["mfu_warning"] == "").all()
    shown = curve[~curve["launch_bound"]]  # all but batch 4's 1 ms step, the sweep's shortest
    assert len(shown) == len(curve) - 2  # a model
    assert shown["of_achievable"].tolist() == pytest.approx(shown["achieved_tflops"].tolist())  # over 1 TFLOP/s


def test_lesson_03_never_shows_a_figure_above_100_percent_and_says_why(lesson_env, busy_cpu, monkeypatch, capsys):
    busy_cpu.again = 0.0021  # measured again, and still beaten: the machine stayed busy
    # 1000 samples a second (b=8: 8 ms; any comparison: 64 ms): 12-14× the ceiling
    fake_timing(monkeypatch, lambda label: int(label.split("=")[1]) * 1e-3 if label.startswith("b=") else 64e-3)
    scope = lesson03(monkeypatch)
    run(scope, "03", 'ResultLog("03_throughput")', "def knee(")
    assert all(math.isnan(y) for line in scope["axes"][0, 1].get_lines() for y in line.get_ydata())  # no point drawn
    printed = capsys.readouterr().out
    assert busy_cpu.asked_again == 1  # flops measured the ceiling again once, when a step first beat it
    curve = scope["curve"]
    assert curve["mfu"].isna().all() and curve["of_achievable"].isna().all()
    assert curve["mfu_warning"].str.contains("above the fp32 ceiling measured here").all()
    assert max(shown_percentages(printed), default=0.0) <= 100.0
    assert printed.count("MFU not shown: ") >= len(curve)
    assert "that ceiling was not this machine's best" in printed


def test_lesson_03_reads_the_reference_memory_whichever_way_its_rows_counted_it(lesson_env, monkeypatch, capsys):
    shipped = gpulab.reference("03_throughput")  # the H100 rows: the caching allocator's peak, under peak_MiB
    recorded = shipped.drop(columns="peak_MiB").assign(device_name="a GPU recorded later",
                                                       tensors_peak_MiB=shipped["peak_MiB"] / 2)
    scope = run({"gpulab": gpulab, "device": CPU}, "03", *LESSON03_START)
    for frame, counted in ((shipped, {"allocator's peak"}), (recorded, {"tensors"}),
                           (pd.concat([shipped, recorded], ignore_index=True), {"allocator's peak", "tensors"})):
        monkeypatch.setattr(gpulab, "reference", lambda name, frame=frame: frame)
        run(scope, "03", "batching.reference_figure(")
        memory, how = batching.reference_memory(frame)
        expected = frame.get("tensors_peak_MiB", pd.Series(math.nan, index=frame.index)).fillna(
            frame.get("peak_MiB", pd.Series(math.nan, index=frame.index)))
        assert memory.tolist() == pytest.approx(expected.tolist()) and set(how) == counted
        labels = {line.get_label() for line in plt.gcf().axes[1].get_lines()}
        assert {label.rsplit(" (", 1)[1].rstrip(")") for label in labels} == counted
        assert ("compare them with each other" in capsys.readouterr().out) == ("allocator's peak" in counted)
        plt.close("all")


# ---- lesson 04 --------------------------------------------------------------------------------------------------
# MFU as the field defines it, where it means something (the plan says so: a toy model gets speed-ups only): over the
# vendor's dense datasheet peak of the precision a step ran in, printed beside it, "of achievable" over the ceiling
# measured here, and one reference peak wherever the precisions are compared side by side.

ALL = ["fp32", "tf32", "fp16", "bf16"]
SHEET = datasheets.SHEETS["H100 SXM"].tflops  # the dense peaks the fake GPU's ceilings carry (a GPU's ceilings do)
ONE_PEAK = ("fp16", SHEET["fp16"])  # the fastest of the four on the datasheet (fp16 and bf16 tie; fp16 comes first)


@pytest.fixture
def gpu_ceilings(monkeypatch):
    """A GPU's ceilings: the fake measured ones, each with its precision's dense datasheet peak; reference_peak, as on
    a GPU, the fastest datasheet peak of the precisions asked for. The lists record what the lesson asked for."""
    asked, compared = [], []

    def ceilings(precisions=None, device=None, **options):
        asked.extend(precisions)
        return {p: flops.Ceiling(p, CEILINGS_TFLOPS[p], datasheet_tflops=SHEET[p]) for p in precisions}

    def reference_peak(precisions, device=None):
        compared.extend(precisions)
        return max(((p, SHEET[p]) for p in precisions), key=lambda pair: pair[1])

    monkeypatch.setattr(flops, "ceilings", ceilings)
    monkeypatch.setattr(flops, "reference_peak", reference_peak)
    return types.SimpleNamespace(asked=asked, compared=compared)


@pytest.fixture
def cpu_ceilings(monkeypatch, fake_ceilings):
    """A CPU's ceilings (no datasheet peak): flops.ceiling answers too, as reference_peak asks it on a CPU."""
    monkeypatch.setattr(flops, "ceiling", lambda p, device=None, **options: flops.Ceiling(p, CEILINGS_TFLOPS[p]))
    return fake_ceilings


def with_sizes(plan, **sizes):
    """``plan`` with some of its sizes replaced (a test's shorter run, or a card's MFU decision)."""
    return dataclasses.replace(plan, sizes={**plan.sizes, **sizes})


def lesson04(monkeypatch, precisions=None, **sizes):
    """Lesson 04 up to its training step: its plan (``sizes`` replaced) and imports, ``precisions`` run (default: what
    this device supports), the task, the model and the step's FLOPs."""
    scope = run({"gpulab": gpulab, "device": CPU}, "04", 'plans.lesson("04")')
    scope["plan"] = with_sizes(scope["plan"], **sizes, **({"precisions": precisions} if precisions else {}))
    return run(scope, "04", "from gpulab import flops, plots, precision, tasks", "def train_step(")


def trained04(monkeypatch, precisions=None, **sizes):
    """``lesson04``, then its training in each precision (a few steps unless ``sizes`` says otherwise)."""
    return run(lesson04(monkeypatch, precisions, **{"steps": 3, **sizes}), "04", "curves, models, runs, trained")


def per_s(step_flops, seconds, tflops):
    """A step's FLOP/s over a peak of ``tflops``."""
    return step_flops / seconds / (tflops * 1e12)


def test_lesson_04_divides_each_step_by_the_dense_peak_of_its_precision_with_of_achievable_beside_it(
        lesson_env, gpu_ceilings, tf32_gpu, monkeypatch, capsys):
    fake_timing(monkeypatch, lambda label: 0.01)
    scope = run(trained04(monkeypatch, ALL, mfu=True), "04", 'ResultLog("04_training_precision")')
    assert gpu_ceilings.asked == ALL and gpu_ceilings.compared == ALL  # each precision's ceiling, once; one peak
    mfu, step_flops = scope["mfu"], scope["step_flops"]
    assert mfu.ran_in == {p: p for p in ALL}  # the "tf32" run divides by the TF32 peak, the fp32 run by fp32's
    for p in ALL:
        u = mfu.of(p, 0.01)
        assert (u.precision, u.datasheet_tflops, u.ceiling_tflops) == (p, SHEET[p], CEILINGS_TFLOPS[p])
        assert u.mfu == pytest.approx(per_s(step_flops, 0.01, SHEET[p]))  # the field's MFU
        assert u.of_achievable == pytest.approx(per_s(step_flops, 0.01, CEILINGS_TFLOPS[p]))
        assert mfu.one_peak(p, 0.01) == pytest.approx(per_s(step_flops, 0.01, ONE_PEAK[1]))
    printed = capsys.readouterr().out
    assert "the bf16 step: MFU over the dense bf16 datasheet peak of 989.5 TFLOP/s; of achievable over the measured" \
           in printed
    assert "the dense fp16 datasheet peak, 989.5 TFLOP/s." in printed
    assert mfu.one_peak_name == "MFU against the dense fp16 peak of 989.5 TFLOP/s"
    bare = dataclasses.replace(mfu, ceilings={"fp32": flops.Ceiling("fp32", 1.0)})
    with pytest.raises(ValueError, match="no measured bf16 ceiling"):  # a bf16 step never falls back on another
        bare.of("bf16", 0.01)


def test_lesson_04_on_a_cpu_compares_precisions_against_the_measured_ceiling_and_names_it(
        lesson_env, cpu_ceilings, monkeypatch, capsys):
    """Full mode on a CPU plans as an H100 (MFU: yes), but a CPU has no vendor peak: of achievable only, named so."""
    fake_timing(monkeypatch, lambda label: 0.01)
    scope = run(trained04(monkeypatch, mfu=True), "04", 'ResultLog("04_training_precision")')
    assert cpu_ceilings == ["fp32", "bf16"]  # a CPU: fp32 and bf16 autocast run, tf32 and fp16 are skipped
    task, plan = scope["task"], scope["plan"]
    weights = [task.dim * plan.width] + [plan.width * plan.width] * (plan.depth - 1) + [plan.width * task.classes]
    assert scope["step_flops"] == plan.batch * (2 * sum(weights) * 2 + 2 * sum(weights[1:]))
    mfu = scope["mfu"]
    u = mfu.of("fp32", 0.01)
    assert math.isnan(u.mfu) and u.of_achievable == pytest.approx(per_s(scope["step_flops"], 0.01, 1.0))
    assert (mfu.reference, mfu.reference_tflops, mfu.from_sheet) == ("bf16", 32.0, False)
    assert mfu.one_peak_text("fp32", 0.01) == f"{per_s(scope['step_flops'], 0.01, 32.0) * 100:.3g} % of the measured bf16 ceiling"
    printed = capsys.readouterr().out
    assert "the fp32 step: no vendor fp32 peak for this device, so no MFU; of achievable over the measured fp32" in printed
    assert "the bf16 ceiling measured here, 32 TFLOP/s (no vendor peak for this device)" in printed


def test_lesson_04s_training_rows_carry_both_denominators_and_their_own_gpu_state(
        lesson_env, gpu_ceilings, tf32_gpu, monkeypatch, capsys):
    bench = {"fp32": 0.040, "tf32": 0.020, "fp16": 0.010, "bf16": 0.008}  # seconds per step, fake
    raced = {"fp32": 0.050, "tf32": 0.025, "fp16": 0.0125, "bf16": 0.010}
    clock = {"fp32": 1410.0, "tf32": 1500.0, "fp16": 1600.0, "bf16": 1700.0}  # each bench's own SM clock

    def fake_bench(fn, *args, label=None, **kwargs):
        p = label.split()[0]
        return Measurement(label, (bench[p],) * 3, "cuda:0", 1, conditions=Conditions(
            1.0, 16, gpu=True, sm_clock_mhz=clock[p], sm_clock_low_mhz=clock[p], sm_clock_high_mhz=clock[p]))

    def fake_compare(baseline, candidate, *, labels, **kwargs):  # the pairs ran at the power limit, at 1200 MHz
        baseline(), candidate()
        capped = Conditions(1.0, 16, gpu=True, sm_clock_mhz=1200.0, sm_clock_low_mhz=1200.0,
                            sm_clock_high_mhz=1200.0, throttle=("SW power cap",))
        return Comparison.of([raced[labels[0]]] * 5, [raced[labels[1]]] * 5, labels=labels, conditions=capped)

    monkeypatch.setattr(gpulab, "bench", fake_bench)
    monkeypatch.setattr(gpulab, "compare", fake_compare)
    scope = run(trained04(monkeypatch, ALL, mfu=True), "04", 'ResultLog("04_training_precision")')
    step_flops = scope["step_flops"]
    written = scope["log"].frame().set_index("precision")
    for p in ALL:
        row = written.loc[p]
        assert row["mfu"] == pytest.approx(per_s(step_flops, bench[p], SHEET[p]))
        assert row["datasheet_tflops"] == SHEET[p] and row["ceiling_precision"] == p
        assert row["of_achievable"] == pytest.approx(per_s(step_flops, bench[p], CEILINGS_TFLOPS[p]))
        assert row["ceiling_tflops"] == CEILINGS_TFLOPS[p]
        assert row["mfu_one_peak"] == pytest.approx(per_s(step_flops, bench[p], ONE_PEAK[1]))
        assert (row["one_peak_precision"], row["one_peak_tflops"]) == ONE_PEAK
    assert reference_columns("04_training_precision") <= set(written.reset_index().columns)  # none renamed
    # each row carries the GPU state of its own bench, not the state of the comparison run after it
    assert written["sm_clock_mhz"].to_dict() == clock
    assert not caveats(written).str.contains("power limit").any()
    speedups = scope["speedup_log"].frame().set_index("candidate")
    assert list(speedups.index) == ALL[1:] and (speedups["sm_clock_mhz"] == 1200.0).all()
    assert speedups["caveat"].str.contains("power limit").all()
    assert speedups["speedup"].to_dict() == pytest.approx({p: raced["fp32"] / raced[p] for p in ALL[1:]})
    shown = scope["steps_shown"]  # the table: each step at its median in the pairs, its MFU beside its own peak
    assert shown["dense peak (TFLOP/s)"].to_dict() == {p: SHEET[p] for p in ALL}
    assert shown["MFU"].to_dict() == pytest.approx({p: per_s(step_flops, raced[p], SHEET[p]) for p in ALL})

    capsys.readouterr()
    run(scope, "04", "named = {p: f")  # the step-time bars: every bar's MFU over the one reference peak
    shares = {p: per_s(step_flops, raced[p], ONE_PEAK[1]) for p in ALL}
    assert scope["named"] == {p: f"{p}, MFU {shares[p] * 100:.3g} % against the dense fp16 peak" for p in ALL}
    assert sorted(ALL, key=shares.get) == sorted(ALL, key=raced.get, reverse=True)  # the faster step reads higher
    titles = [ax.get_title() for fig in map(plt.figure, plt.get_fignums()) for ax in fig.axes]
    assert any("every bar's MFU over one peak: MFU against the dense fp16 peak of 989.5 TFLOP/s" in t for t in titles)
    printed = capsys.readouterr().out
    for p in ALL:  # each step's time and MFU in its interleaved pairs, beside the verdicts printed from those pairs
        line = next(line for line in printed.splitlines() if line.startswith(f"  {p}: "))
        mfu, achievable = per_s(step_flops, raced[p], SHEET[p]), per_s(step_flops, raced[p], CEILINGS_TFLOPS[p])
        assert line.startswith(f"  {p}: {raced[p] * 1e3:.3g} ms per step")
        assert f"MFU {flops.percent(mfu)} (" in line and f"over the dense {p} peak of {SHEET[p]:g})" in line
        assert f"{flops.percent(achievable)} of achievable (the {p} ceiling measured here" in line
        assert line.endswith(f"{per_s(step_flops, raced[p], ONE_PEAK[1]) * 100:.3g} % against the dense fp16 peak")


def test_lesson_04_shows_a_toy_models_speed_ups_and_no_mfu(lesson_env, cuda_stand_in, gpu_ceilings, monkeypatch,
                                                          capsys):
    """The H200 of 2026-11-28 printed "MFU 0.00115 %" for the quick mode's 22,538-parameter MLP. Its step is set by
    launches, not arithmetic: the plan says so (the CPU playing the H200, quick mode), and the lesson shows speed-ups,
    samples/s and no MFU."""
    fake_timing(monkeypatch, lambda label: {"fp32": 0.002}.get(label.split()[0], 0.001))
    scope = trained04(monkeypatch)
    assert scope["precisions"] == ALL and scope["plan"].mfu is False
    assert "the 22,538-parameter MLP is a toy here" in scope["plan"].why["mfu"]
    capsys.readouterr()
    run(scope, "04", 'ResultLog("04_training_precision")', "named = {p: f")
    printed = capsys.readouterr().out
    assert scope["mfu"] is None and gpu_ceilings.asked == []  # no ceiling measured for a step MFU would not suit
    assert f"No MFU here: {scope['plan'].why['mfu']}." in printed
    assert "MFU" not in printed.replace(f"No MFU here: {scope['plan'].why['mfu']}.", "")
    shown = scope["steps_shown"]
    assert not [c for c in shown if "MFU" in c or "achievable" in c]
    assert shown["speed-up over fp32"].dropna().to_dict() == pytest.approx({p: 2.0 for p in ALL[1:]})
    assert shown["samples/s"].to_dict() == pytest.approx({p: scope["plan"].batch / s for p, s in
                                                          scope["paired_s"].items()})
    logged = scope["log"].frame()
    assert "mfu" not in logged and reference_columns("04_training_precision") <= set(logged.columns)
