"""Lesson 04's numbers on a GPU, checked on a CPU with the real H200 runs' rows and injected timings: the datasheet
figures come from gpulab.datasheets (this card's own entry, with its source), the memory roof is measured beyond the
L2 cache in every mode, each row of a GPU measurement carries the GPU's state over that measurement, and the figures
beside each verdict are those of the pairs the verdict comes from."""

import statistics
import types
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import Comparison, datasheets, flops, plans, plots, precision
from gpulab.conditions import Conditions
from gpulab.timing import Measurement

from .test_mfu_lessons_03_04 import ALL, code, lesson_env, run, trained04  # noqa: F401 (lesson_env: a fixture)

DATA = Path(__file__).parent / "data" / "lesson04"
H200_ROWS = DATA / "h200_quick_04_matmul_precision.csv"


@pytest.fixture
def quiet_plots(monkeypatch):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    yield
    plt.close("all")


def h200_rows() -> pd.DataFrame:
    """What lesson 04's matmul cell wrote on the H200 (quick mode, 2026-11-27)."""
    return pd.read_csv(H200_ROWS)


def sheet_of(entry: str) -> dict:
    return {p: datasheets.SHEETS[entry].tflops.get(p) for p in ALL}


def twice_as_fast() -> dict:
    return {p: Comparison.of([2.0] * 5, [1.0] * 5, labels=("fp32", p)) for p in ALL[1:]}


def test_the_roofline_draws_each_cards_own_dense_datasheet_peaks(quiet_plots, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "roofline", lambda frame, **kwargs: drawn.append(kwargs))
    h200, h100 = h200_rows(), gpulab.reference("04_matmul_precision")
    precision.roofline(h200, "H200")
    precision.roofline(h100[h100["device_name"] == "NVIDIA H100 80GB HBM3"], "H100")
    precision.roofline(h200.assign(device="cpu", device_name="a CPU"), "CPU")
    assert drawn[0]["datasheet"] == sheet_of("H200 SXM")  # the H200 has its own entry: no H100 figure stands in
    assert drawn[1]["datasheet"] == sheet_of("H100 SXM")
    assert drawn[2]["datasheet"] == {p: None for p in ALL}  # a CPU has no vendor peak
    for kwargs in drawn[:2]:  # every measured peak below its card's dense peak
        assert all(kwargs["peaks"][p] < kwargs["datasheet"][p] for p in ALL)


def test_the_matmul_table_shows_this_cards_datasheet_entry_with_its_source():
    table = precision.matmul_table(h200_rows(), twice_as_fast(), "NVIDIA H200")
    note = precision.datasheet_note(table, "NVIDIA H200")
    sheet = datasheets.SHEETS["H200 SXM"]
    assert note == ("NVIDIA H200 is the 'H200 SXM' entry of gpulab.datasheets, dense peaks in TFLOP/s: fp32 67, tf32 "
                    f"494.5, fp16 989.5, bf16 989.5, fp8 1978.9 (source: {sheet.source}).")
    assert table["dense datasheet peak"].to_dict() == sheet_of("H200 SXM")
    assert (table["measured peak of datasheet"] < 1).all()
    assert precision.datasheet_note(table, None) == "No datasheet figures for a CPU in gpulab.datasheets: measured " \
                                                    "peaks only."
    assert "2.00×" in precision.styled(table).to_html()  # speed-ups shown as such


def test_a_measured_peak_above_the_datasheet_says_the_entry_is_not_this_cards():
    rows = h200_rows()
    rows.loc[(rows["kind"] == "peak") & rows["precision"].isin(["fp16", "bf16"]), "tflops"] *= 100  # above 312
    table = precision.matmul_table(rows, twice_as_fast(), "NVIDIA A100-SXM4-80GB")
    note = precision.datasheet_note(table, "NVIDIA A100-SXM4-80GB")
    assert "'A100 SXM 80GB' entry" in note
    assert "Measured above the datasheet's dense peak in fp16, bf16: that entry is not this card's figure" in note


def test_the_precision_table_lists_every_datasheet_card_with_its_source(capsys):
    shown = []
    scope = {"torch": torch, "gpulab": gpulab, "precision": precision, "device": torch.device("cpu"),
             "info": types.SimpleNamespace(name="cpu"), "display": lambda styler: shown.append(styler.data)}
    exec(compile(code("04", "torch.cuda.is_bf16_supported()"), "<lesson 04: which precision>", "exec"), scope)
    table, sheets = shown[0], datasheets.table()
    assert list(table.index) == list(sheets.index)  # T4 ... H200 ... B200: every card a learner meets
    for p in ("fp32", "tf32", "fp16", "bf16", "fp8"):
        assert table[f"{p} TFLOP/s (dense)"].equals(sheets[p])
    assert table["source"].equals(sheets["source"])
    assert table.loc["H200 SXM", "compute capability"] == "9.0" and table.loc["H200 SXM", "bf16"] == "native"
    assert table.loc["T4", "bf16"] == "no" and table.loc["A10G", "compute capability"] == "8.6"
    assert table.loc["T4", "fp16"] == "native" and table.loc["T4", "tf32"] == "no"


def test_the_memory_roof_is_measured_beyond_the_l2_cache_on_a_gpu_in_every_mode():
    """On the H200 in quick mode the roof was a 16 MiB copy (2 × 16 MiB fit in its 50 MB L2), under a text that says
    1 GiB, far larger than any L2: the plan gives a GPU 1 GiB in every mode, a CPU's quick mode 16 MiB."""
    assert "src = torch.empty(plan.copy_elements, device=device)" in code("04", "device copy")
    for card in ("Tesla T4", "NVIDIA H200"):
        for quick in (True, False):
            assert plans.plan_for("04", plans.Card.named(card), quick=quick).copy_elements * 4 == 2**30
    assert plans.plan_for("04", plans.Card("CPU", None, 2, 0), quick=True).copy_elements * 4 == 16 * 2**20


def fake_ceiling(tflops: dict):
    """flops.ceiling answering ``tflops[p]`` at 256×512×128, with the GPU at 1234 MHz while its fastest shape was
    timed; ``asked`` records each precision asked for."""
    asked = []

    def ceiling(p, device=None, **options):
        asked.append(p)
        return flops.Ceiling(p, tflops[p], (256, 512, 128), conditions=Conditions(
            1.0, 16, gpu=True, sm_clock_mhz=1234.0, sm_clock_low_mhz=1234.0, sm_clock_high_mhz=1234.0))
    ceiling.asked = asked
    return ceiling


def test_each_matmul_row_carries_the_gpu_state_of_its_own_measurement(quiet_plots, results_dir, monkeypatch):
    rate = {"fp32": 1.0, "bf16": 4.0}  # TFLOP/s at n = 128, fake; each size n runs at n / 128 of it
    peak = {"fp32": 5.0, "bf16": 0.5}  # fp32's ceiling beats its sweep, bf16's does not

    def bench(fn, *args, label=None, **kwargs):
        if label == "device copy":
            return Measurement(label, (1e-3,) * 3, "cuda:0", 1, conditions=Conditions(1.0, 16, gpu=True,
                                                                                      sm_clock_mhz=999.0))
        p, _, n = label.split()
        seconds = 2 * int(n) ** 3 / (rate[p] * int(n) / 128 * 1e12)
        clock = 1000.0 + int(n)  # each size at its own clock
        return Measurement(label, (seconds,) * 3, "cuda:0", 1, conditions=Conditions(
            1.0, 16, gpu=True, sm_clock_mhz=clock, sm_clock_low_mhz=clock, sm_clock_high_mhz=clock))

    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        return Comparison.of([2.0] * 5, [1.0] * 5, labels=labels, conditions=Conditions(1.0, 16, gpu=True,
                                                                                       sm_clock_mhz=777.0))

    monkeypatch.setattr(gpulab, "bench", bench)
    monkeypatch.setattr(gpulab, "compare", compare)
    ceiling = fake_ceiling(peak)
    monkeypatch.setattr(flops, "ceiling", ceiling)
    scope = run({"gpulab": gpulab, "device": torch.device("cpu")}, "04", 'plans.lesson("04")',
                "from gpulab import flops, plots, precision, tasks")
    scope["precisions"] = ["fp32", "bf16"]
    run(scope, "04", "device copy")
    assert ceiling.asked == ["fp32", "bf16"]  # one ceiling search per precision: the one section 3 divides by
    rows = scope["log"].frame()
    peaks = rows[rows["kind"] == "peak"].set_index("precision")
    assert peaks.loc["fp32", "tflops"] == 5.0 and peaks.loc["fp32", "sm_clock_mhz"] == 1234.0  # the peak's own span
    assert peaks.loc["fp32", ["m", "n", "k"]].tolist() == [256, 512, 128]  # the ceiling's fastest shape
    assert peaks.loc["bf16", "tflops"] == pytest.approx(4.0) and peaks.loc["bf16", "n"] == 128
    assert peaks.loc["bf16", "sm_clock_mhz"] == 1128.0  # the sweep's fastest matmul, and the state it ran in
    swept = rows[rows["kind"] == "matmul"]
    assert (swept["sm_clock_mhz"] == 1000.0 + swept["n"]).all()
    assert swept["tflops"].tolist() == pytest.approx([rate[p] * n / 128 for p, n in zip(swept["precision"], swept["n"])])
    assert rows.loc[rows["kind"] == "copy", "sm_clock_mhz"].tolist() == [999.0]
    assert rows.loc[rows["kind"] == "speedup over fp32", "sm_clock_mhz"].tolist() == [777.0]


# ----- the figures beside each verdict come from the pairs the verdict comes from (the H200's smoke run, 2026-11-28) --

def h200_2026_11_28(name: str) -> pd.DataFrame:
    return pd.read_csv(DATA / f"h200_2026-11-28_quick_{name}.csv")


def h200_pairs(baseline_s: float, row) -> Comparison:
    """Five interleaved pairs as the H200 measured them: fp32 at ``baseline_s`` beside a candidate whose ratios span
    the row's interval around its median speed-up (so the interval and the verdict are the run's own)."""
    ratios = [row.speedup_low, row.speedup_low, row.speedup, row.speedup_high, row.speedup_high]
    return Comparison.of([baseline_s] * 5, [baseline_s / r for r in ratios], labels=("fp32", row.precision))


def test_the_matmul_tables_throughput_is_the_one_its_speedup_and_verdict_come_from():
    """On the H200 at n = 128 the table showed tf32 at 0.225 TFLOP/s beside fp32's 0.290 (the sweep, one timing per
    size, apart) and, in the same row, tf32 1.25× faster than fp32 beyond the noise (interleaved pairs); the text said
    tf32 was the fastest. Each precision's throughput is now its median in the pairs its speed-up comes from."""
    rows = h200_2026_11_28("04_matmul_precision")
    speedups = rows[rows["kind"] == "speedup over fp32"]
    fp32_s = rows.query("kind == 'matmul' and precision == 'fp32' and n == 128")["median_s"].iloc[0]
    pairs = {row.precision: h200_pairs(fp32_s, row) for row in speedups.itertuples()}
    assert {p: c.verdict for p, c in pairs.items()} == dict(zip(speedups["precision"], speedups["verdict"]))
    table = precision.matmul_table(rows, pairs, "NVIDIA H200")
    throughput = table["TFLOP/s at n=128 (pairs)"]
    for p, c in pairs.items():
        assert throughput[p] / throughput["fp32"] == pytest.approx(statistics.median(c.ratios)), p
    assert throughput["tf32"] > throughput["fp32"]  # tf32: 1.25× faster, beyond the noise, and shown faster


def h200_training(monkeypatch):
    """gpulab.bench answers each step's median as the H200 benched it on 2026-11-28, gpulab.compare its pairs."""
    benched = h200_2026_11_28("04_training_precision").set_index("precision")["median_s"].to_dict()
    speedups = h200_2026_11_28("04_training_speedups").rename(columns={"candidate": "precision"})
    pairs = {row.precision: h200_pairs(benched["fp32"], row) for row in speedups.itertuples()}
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kwargs: Measurement(
        label, (benched[label.split()[0]],) * 3, "cuda:0", 1))

    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        return pairs[labels[1]]

    monkeypatch.setattr(gpulab, "compare", compare)
    return benched, pairs


def test_the_training_tables_step_times_are_those_of_the_pairs_beside_them(lesson_env, monkeypatch, capsys):  # noqa: F811
    """On the H200 the table and the text showed bf16 at 2.03 ms per step and fp32 at 1.98 ms (each benched apart) beside
    "bf16 vs fp32: 0.79×, slower" (the pairs): 2 % apart in the figures, 21 % in the verdict. Each step's time shown is
    now its median in the pairs its verdict comes from."""
    benched, pairs = h200_training(monkeypatch)
    scope = run(trained04(monkeypatch, ALL), "04", 'ResultLog("04_training_precision")')
    shown = scope["steps_shown"]
    for p, c in pairs.items():
        assert shown.loc["fp32", "ms per step (pairs)"] / shown.loc[p, "ms per step (pairs)"] == pytest.approx(c.speedup)
        assert shown.loc[p, "speed-up over fp32"] == pytest.approx(c.speedup)
    assert shown.loc["bf16", "ms per step (pairs)"] > 1.2 * shown.loc["fp32", "ms per step (pairs)"]  # slower, shown so
    assert scope["log"].frame().set_index("precision")["median_s"].to_dict() == pytest.approx(benched)  # logged: benches
    capsys.readouterr()
    run(scope, "04", "named = {p: f")
    bf16 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  bf16: "))
    assert bf16.startswith(f"  bf16: {benched['fp32'] / pairs['bf16'].speedup * 1e3:.3g} ms per step")


def test_a_reference_drawn_from_the_logged_rows_shows_the_step_times_the_table_showed(lesson_env, monkeypatch):  # noqa: F811
    """The logged rows keep each step's own bench (median_s, with the GPU's state over it) and the time the table
    showed, its median in the pairs (paired_median_s): shipped as a reference, the H200's rows of 2026-11-28 draw
    bf16 1.27× slower than fp32, as the pairs said (0.79×), not 2 % slower as the benches did."""
    benched, pairs = h200_training(monkeypatch)
    scope = run(trained04(monkeypatch, ALL), "04", 'ResultLog("04_training_precision")')
    logged = scope["log"].frame()
    by_precision = logged.set_index("precision")
    assert by_precision["median_s"].to_dict() == pytest.approx(benched)
    assert (by_precision["paired_median_s"] * 1e3).to_dict() == pytest.approx(
        scope["steps_shown"]["ms per step (pairs)"].to_dict())

    drawn = []
    monkeypatch.setattr(gpulab, "reference", lambda name: logged.assign(device_name="NVIDIA H200") if
                        name == "04_training_precision" else pd.DataFrame())
    monkeypatch.setattr(plots, "bars", lambda values, **kwargs: drawn.append((values, kwargs["title"])))
    run(scope, "04", "named = {p: f")
    values, title = drawn[-1]
    assert "NVIDIA H200; ratios of shipped medians (each step's median in its pairs against fp32, as above)" in title
    assert values == pytest.approx(scope["steps_shown"]["ms per step (pairs)"].to_dict())
    assert values["bf16"] / values["fp32"] == pytest.approx(1 / pairs["bf16"].speedup)
    monkeypatch.setattr(gpulab, "reference", lambda name: logged.drop(columns="paired_median_s").assign(
        device_name="NVIDIA H100 80GB HBM3") if name == "04_training_precision" else pd.DataFrame())
    run(scope, "04", "named = {p: f")  # rows shipped before the pairs were logged: the benches, said so
    values, title = drawn[-1]
    assert "(each step benched apart), no spread" in title and values == pytest.approx({p: s * 1e3 for p, s in benched.items()})
