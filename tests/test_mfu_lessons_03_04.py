"""Lessons 03 and 04 report MFU beside samples/s and step time: a training step's FLOPs, counted once with
FlopCounterMode, over the measured ceiling of the precision that step ran in, never another precision's.

The lessons' own code cells run here on the CPU, with fake ceilings far apart (so that dividing by the wrong one
cannot pass), fake timings where a cell times, and, where it matters, a GPU with TF32 standing in for the CPU in
``flops.precision_of``. Nothing is asserted on a real timing."""

import math
import types

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import Comparison, datasheets, flops
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


def expected_mfu(flops_per_unit, units_per_s, precision):
    return flops_per_unit * units_per_s / (CEILINGS_TFLOPS[precision] * 1e12)


# ---- lesson 03 --------------------------------------------------------------------------------------------------


def lesson03(monkeypatch):
    """Lesson 03 up to its MFU cell: imports, the two models, the FLOPs counted and the ceilings asked for."""
    return run({"gpulab": gpulab, "device": CPU}, "03", "from gpulab import batch_finder", "MODELS = {",
               "def mfu_of(")


def test_lesson_03_counts_each_models_training_flops_once(lesson_env, fake_ceilings, monkeypatch):
    scope = lesson03(monkeypatch)
    per_sample, precision = scope["work"]["WideMLP"]
    # WideMLP(width=1024): 3072 → 1024 → 1024 → 1024 → 10. Forward and weight gradients: 2 FLOPs per weight each;
    # input gradients for every layer but the first (the images need none).
    weights = [3072 * 1024, 1024 * 1024, 1024 * 1024, 1024 * 10]
    assert per_sample == 2 * sum(weights) * 2 + 2 * sum(weights[1:])
    assert scope["work"]["SmallCNN"][0] > 0
    assert fake_ceilings == ["fp32"] and precision == "fp32"  # on a CPU: fp32 only, measured once


def test_lesson_03_divides_convolutions_by_tf32_and_fp32_matmuls_by_fp32_on_a_tf32_gpu(
        lesson_env, fake_ceilings, tf32_gpu, monkeypatch):
    scope = lesson03(monkeypatch)
    assert {name: p for name, (_, p) in scope["work"].items()} == {"SmallCNN": "tf32", "WideMLP": "fp32"}
    assert fake_ceilings == ["fp32", "tf32"]  # only the precisions the lesson's steps run in
    for name, (per_sample, p) in scope["work"].items():
        u = scope["mfu_of"](name, 1000.0)
        assert (u.precision, u.ceiling_tflops) == (p, CEILINGS_TFLOPS[p])
        assert u.mfu == pytest.approx(expected_mfu(per_sample, 1000.0, p))
    # The precision follows the switch: TF32 on for matmuls puts the MLP under the TF32 ceiling too.
    torch.set_float32_matmul_precision("high")
    assert scope["step_precision"](scope["MODELS"]["WideMLP"]()) == "tf32"
    torch.set_float32_matmul_precision("highest")
    assert scope["step_precision"](scope["MODELS"]["WideMLP"]()) == "fp32"


def test_lesson_03s_sweep_and_accumulation_rows_carry_each_models_mfu(lesson_env, fake_ceilings, tf32_gpu,
                                                                      monkeypatch):
    def bench_s(label):  # b=8: 8 ms; k=2: 64 / (1000 + 2) s
        kind, value = label.split("=")
        return int(value) * 1e-3 if kind == "b" else 64 / (1000 + int(value))

    fake_timing(monkeypatch, bench_s, compare_s=lambda label: 0.01)
    scope = lesson03(monkeypatch)
    run(scope, "03", 'ResultLog("03_throughput")')
    curve = scope["curve"]
    assert set(curve.model) == {"SmallCNN", "WideMLP"}
    assert curve.samples_per_s.tolist() == pytest.approx([1000.0] * len(curve))
    for row in curve.itertuples():
        per_sample, p = scope["work"][row.model]
        assert row.ceiling_precision == p and row.ceiling_tflops == CEILINGS_TFLOPS[p]
        assert row.mfu == pytest.approx(expected_mfu(per_sample, 1000.0, p))
        assert row.flops_per_sample == per_sample
    written = scope["log"].frame()
    assert reference_columns("03_throughput") <= set(written.columns)  # columns added, none renamed
    assert written["mfu"].tolist() == pytest.approx(curve["mfu"].tolist())

    run(scope, "03", "def make_accumulation_step(")
    per_sample, p = scope["work"]["SmallCNN"]
    assert p == "tf32"
    for row in scope["accumulation"].itertuples():
        assert row.samples_per_s == pytest.approx(1000 + row.k)
        assert row.mfu == pytest.approx(expected_mfu(per_sample, 1000 + row.k, "tf32"))
        assert scope["per_sample_a_second"] * row.samples_per_s == pytest.approx(row.mfu)  # the second axis
    assert "mfu" in scope["accumulation_log"].frame().columns


def test_lesson_03s_convergence_runs_carry_the_students_mfu(lesson_env, fake_ceilings, tf32_gpu, monkeypatch):
    fake_timing(monkeypatch, lambda label: 0.01)
    scope = lesson03(monkeypatch)
    run(scope, "03", "def train_for(")
    per_sample, p = scope["work"]["student"]
    assert p == "fp32" and "fp32" in scope["ceilings"]  # an MLP: fp32 matmuls, TF32 off
    features, width = scope["features"], scope["student_width"]
    weights = [features * width, width * width, width * 10]
    assert per_sample == 2 * sum(weights) * 2 + 2 * sum(weights[1:])

    def train_for(batch_size, lr, seconds, evals=8):  # 2 s of training, 5000 samples a second whatever the batch
        return [{"seconds": 1.0 * i, "samples": 5000 * i, "steps": 5000 * i // batch_size,
                 "test_loss": 2.0 / (i + math.log2(batch_size))} for i in (1, 2)]

    scope["train_for"] = train_for
    run(scope, "03", 'ResultLog("03_convergence")')
    assert scope["convergence"]["mfu"].tolist() == pytest.approx([expected_mfu(per_sample, 5000, "fp32")] * 12)
    assert scope["final"]["mfu"].tolist() == pytest.approx([expected_mfu(per_sample, 5000, "fp32")] * 6)


# ---- lesson 04 --------------------------------------------------------------------------------------------------
# MFU as the field defines it: over the vendor's dense datasheet peak of the precision a step ran in, "of achievable"
# over the ceiling measured here beside it, and one reference peak wherever the precisions are compared side by side.

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


def lesson04(monkeypatch, precisions=None):
    """Lesson 04 up to its MFU cell, running ``precisions`` (default: what this device supports)."""
    scope = run({"gpulab": gpulab, "device": CPU}, "04", "flops, plots, precision, tasks")  # the imports
    if precisions:
        scope["precisions"] = precisions
    return run(scope, "04", "def train_step(", "def step_mfu(")


def per_s(step_flops, seconds, tflops):
    """A step's FLOP/s over a peak of ``tflops``."""
    return step_flops / seconds / (tflops * 1e12)


def test_lesson_04_divides_each_step_by_the_dense_peak_of_its_precision_with_of_achievable_beside_it(
        lesson_env, gpu_ceilings, tf32_gpu, monkeypatch, capsys):
    scope = lesson04(monkeypatch, ALL)
    assert gpu_ceilings.asked == ALL and gpu_ceilings.compared == ALL  # each precision's ceiling, once; one peak
    assert {p: scope["step_precision"](p) for p in ALL} == {p: p for p in ALL}
    # the fp32 run switches TF32 off, whatever the switch says when its MFU is worked out
    torch.set_float32_matmul_precision("high")
    assert scope["step_precision"]("fp32") == "fp32"
    step_flops = scope["step_flops"]
    for p in ALL:
        u = scope["step_mfu"](p, 0.01)
        assert (u.precision, u.datasheet_tflops, u.ceiling_tflops) == (p, SHEET[p], CEILINGS_TFLOPS[p])
        assert u.mfu == pytest.approx(per_s(step_flops, 0.01, SHEET[p]))  # the field's MFU
        assert u.of_achievable == pytest.approx(per_s(step_flops, 0.01, CEILINGS_TFLOPS[p]))
        assert scope["one_peak"](u) == pytest.approx(per_s(step_flops, 0.01, ONE_PEAK[1]))
    printed = capsys.readouterr().out
    assert "the bf16 step: MFU over the dense bf16 datasheet peak of 989.5 TFLOP/s; of achievable over the measured" \
           in printed
    assert "the dense fp16 datasheet peak, 989.5 TFLOP/s." in printed and scope["one_peak_name"] == "MFU against the fp16 peak"
    scope["ceilings"] = {"fp32": flops.Ceiling("fp32", 1.0)}  # a bf16 step never falls back on another ceiling
    with pytest.raises(ValueError, match="no measured bf16 ceiling"):
        scope["step_mfu"]("bf16", 0.01)


def test_lesson_04_on_a_cpu_compares_precisions_against_the_measured_ceiling_and_names_it(
        lesson_env, cpu_ceilings, monkeypatch, capsys):
    scope = lesson04(monkeypatch)
    assert cpu_ceilings == ["fp32", "bf16"]  # a CPU: fp32 and bf16 autocast run, tf32 and fp16 are skipped
    task, width, batch = scope["task"], scope["width"], scope["batch_size"]
    weights = [task.dim * width] + [width * width] * (scope["depth"] - 1) + [width * task.classes]
    assert scope["step_flops"] == batch * (2 * sum(weights) * 2 + 2 * sum(weights[1:]))
    # no vendor peak for a CPU: MFU unknown, of achievable shown; one peak is the fastest ceiling measured here
    u = scope["step_mfu"]("fp32", 0.01)
    assert math.isnan(u.mfu) and u.of_achievable == pytest.approx(per_s(scope["step_flops"], 0.01, 1.0))
    assert (scope["reference"], scope["reference_tflops"], scope["from_sheet"]) == ("bf16", 32.0, False)
    assert scope["one_peak_text"](u) == f"{per_s(scope['step_flops'], 0.01, 32.0) * 100:.3g} % of the measured bf16 ceiling"
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
    scope = lesson04(monkeypatch, ALL)
    scope["steps"] = 3  # a few training steps per precision: the numbers here are fake anyway
    run(scope, "04", 'ResultLog("04_training_precision")')
    training, step_flops = scope["training"], scope["step_flops"]
    for p in ALL:
        row = training.loc[p]
        assert row["mfu"] == pytest.approx(per_s(step_flops, bench[p], SHEET[p]))
        assert row["datasheet_tflops"] == SHEET[p] and row["ceiling_precision"] == p
        assert row["of_achievable"] == pytest.approx(per_s(step_flops, bench[p], CEILINGS_TFLOPS[p]))
        assert row["ceiling_tflops"] == CEILINGS_TFLOPS[p]
        assert row["mfu_one_peak"] == pytest.approx(per_s(step_flops, bench[p], ONE_PEAK[1]))
        assert (row["one_peak_precision"], row["one_peak_tflops"]) == ONE_PEAK
    written = scope["log"].frame().set_index("precision")
    assert reference_columns("04_training_precision") <= set(written.reset_index().columns)  # none renamed
    # each row carries the GPU state of its own bench, not the state of the comparison run after it
    assert written["sm_clock_mhz"].to_dict() == clock
    assert not caveats(written).str.contains("power limit").any()
    speedups = scope["speedup_log"].frame().set_index("candidate")
    assert list(speedups.index) == ALL[1:] and (speedups["sm_clock_mhz"] == 1200.0).all()
    assert speedups["caveat"].str.contains("power limit").all()
    assert speedups["speedup"].to_dict() == pytest.approx({p: raced["fp32"] / raced[p] for p in ALL[1:]})

    run(scope, "04", "named = {p: f")  # the step-time bars: every bar's MFU over the one reference peak
    shares = {p: per_s(step_flops, raced[p], ONE_PEAK[1]) for p in ALL}
    assert scope["named"] == {p: f"{p}, MFU {shares[p] * 100:.3g} % against the fp16 peak" for p in ALL}
    assert sorted(ALL, key=shares.get) == sorted(ALL, key=raced.get, reverse=True)  # the faster step reads higher
    titles = [ax.get_title() for fig in map(plt.figure, plt.get_fignums()) for ax in fig.axes]
    assert any("every bar's MFU over one peak: 989.5 TFLOP/s, the dense fp16 datasheet peak" in t for t in titles)
    capsys.readouterr()
    run(scope, "04", "Each step's MFU")
    printed = capsys.readouterr().out
    for p in ALL:
        line = next(line for line in printed.splitlines() if line.startswith(f"  {p}: "))
        mfu, achievable = per_s(step_flops, bench[p], SHEET[p]), per_s(step_flops, bench[p], CEILINGS_TFLOPS[p])
        assert f"MFU {mfu:.1%} (" in line and f"over the dense {p} peak of {SHEET[p]:g})" in line
        assert f"{achievable:.1%} of achievable (the {p} ceiling measured here" in line
        assert line.endswith(f"{per_s(step_flops, bench[p], ONE_PEAK[1]) * 100:.3g} % against the fp16 peak")
