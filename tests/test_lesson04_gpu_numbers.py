"""Lesson 04's numbers on a GPU, checked on a CPU with the real H200 run's rows and injected timings: the datasheet
figures come from gpulab.datasheets (this card's own entry, with its source), the memory roof is measured beyond the
L2 cache in every mode, and each row of a GPU measurement carries the GPU's state over that measurement."""

import ast
import types
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from tqdm.auto import tqdm

import gpulab
from gpulab import Comparison, datasheets, flops, plots, precision
from gpulab.conditions import Conditions
from gpulab.timing import Measurement

from .test_mfu_lessons_03_04 import code
from .test_notebooks_00_04_gpu_path import function_source

H200_ROWS = Path(__file__).parent / "data" / "lesson04" / "h200_quick_04_matmul_precision.csv"
ALL = ["fp32", "tf32", "fp16", "bf16"]
GPU = torch.device("cuda")  # a CUDA device: gpulab.on_gpu says yes to it, and nothing here runs on it


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


def test_the_roofline_draws_each_cards_own_dense_datasheet_peaks(quiet_plots):
    drawn = []
    scope = {"datasheets": datasheets, "precision": precision,
             "plots": types.SimpleNamespace(roofline=lambda frame, **kwargs: drawn.append(kwargs))}
    exec(compile(function_source("04", "roofline"), "<lesson 04: roofline>", "exec"), scope)
    h200, h100 = h200_rows(), gpulab.reference("04_matmul_precision")
    scope["roofline"](h200, "H200")
    scope["roofline"](h100[h100["device_name"] == "NVIDIA H100 80GB HBM3"], "H100")
    scope["roofline"](h200.assign(device="cpu", device_name="a CPU"), "CPU")
    assert drawn[0]["datasheet"] == sheet_of("H200 SXM")  # the H200 has its own entry: no H100 figure stands in
    assert drawn[1]["datasheet"] == sheet_of("H100 SXM")
    assert drawn[2]["datasheet"] == {p: None for p in ALL}  # a CPU has no vendor peak
    for kwargs in drawn[:2]:  # every measured peak below its card's dense peak
        assert all(kwargs["peaks"][p] < kwargs["datasheet"][p] for p in ALL)


def matmul_table_cell(name: str, rows: pd.DataFrame, capsys) -> tuple[dict, str]:
    """Lesson 04's roofline-and-table cell, run as on a CUDA device called ``name`` with ``rows`` measured."""
    sweep = rows[rows["kind"] == "matmul"].astype({"n": int})
    scope = {"pd": pd, "plots": plots, "datasheets": datasheets, "precision": precision, "device": GPU, "gpulab": gpulab,
             "info": types.SimpleNamespace(name=name), "matmuls": rows, "sweep": sweep, "sizes": sorted(set(sweep["n"])),
             "precisions": ALL, "over_fp32": {p: Comparison.of([2.0] * 5, [1.0] * 5, labels=("fp32", p)) for p in ALL[1:]}}
    capsys.readouterr()
    exec(compile(code("04", "def roofline("), "<lesson 04: roofline and table>", "exec"), scope)
    return scope, capsys.readouterr().out


def test_the_matmul_table_shows_this_cards_datasheet_entry_with_its_source(quiet_plots, capsys):
    scope, printed = matmul_table_cell("NVIDIA H200", h200_rows(), capsys)
    sheet = datasheets.SHEETS["H200 SXM"]
    assert (f"NVIDIA H200 is the 'H200 SXM' entry of gpulab.datasheets, dense peaks in TFLOP/s: fp32 67, tf32 494.5, "
            f"fp16 989.5, bf16 989.5, fp8 1978.9 (source: {sheet.source}).") in printed
    table = scope["table"]
    assert table["dense datasheet peak"].to_dict() == sheet_of("H200 SXM")
    assert (table["measured peak of datasheet"] < 1).all() and "above the datasheet" not in printed


def test_a_measured_peak_above_the_datasheet_says_the_entry_is_not_this_cards(quiet_plots, capsys):
    rows = h200_rows()
    rows.loc[(rows["kind"] == "peak") & rows["precision"].isin(["fp16", "bf16"]), "tflops"] *= 100  # above 312
    _, printed = matmul_table_cell("NVIDIA A100-SXM4-80GB", rows, capsys)
    assert "'A100 SXM 80GB' entry" in printed
    assert "Measured above the datasheet's dense peak in fp16, bf16: that entry is not this card's figure" in printed


def test_the_precision_table_lists_every_datasheet_card_with_its_source(capsys):
    shown = []
    scope = {"pd": pd, "torch": torch, "gpulab": gpulab, "datasheets": datasheets, "precision": precision,
             "device": torch.device("cpu"),
             "info": types.SimpleNamespace(name="cpu"), "display": lambda styler: shown.append(styler.data)}
    exec(compile(code("04", "torch.cuda.is_bf16_supported()"), "<lesson 04: which precision>", "exec"), scope)
    table, sheets = shown[0], datasheets.table()
    assert list(table.index) == list(sheets.index)  # T4 ... H200 ... B200: every card a learner meets
    for p in ("fp32", "tf32", "fp16", "bf16", "fp8"):
        assert table[f"{p} TFLOP/s (dense)"].equals(sheets[p])
    assert table["source"].equals(sheets["source"])
    assert table.loc["H200 SXM", "compute capability"] == "9.0" and table.loc["H200 SXM", "bf16"] == "native"
    assert table.loc["T4", "bf16"] == "no" and table.loc["A10G", "compute capability"] == "8.6"
    assert "?" not in set(table["compute capability"])  # every card's capability is known


def copy_bytes(device) -> int:
    """The bytes of the source of lesson 04's memory-roof copy on ``device``, in quick mode: the cell's statements
    up to the source tensor, run with torch.empty recording its size."""
    tree, sizes = ast.parse(code("04", "device copy")), []
    fake_torch = types.SimpleNamespace(empty=lambda n, device=None: sizes.append(n))
    scope = {"gpulab": gpulab, "device": device, "torch": fake_torch}
    for node in tree.body:
        if isinstance(node, ast.Assign) and not sizes:
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if names & {"copy_elements", "src"}:
                exec(compile(ast.Module([node], []), "<lesson 04: the copy's size>", "exec"), scope)
    return 4 * sizes[0]  # fp32


def test_the_memory_roof_is_measured_beyond_the_l2_cache_on_a_gpu_in_every_mode(monkeypatch):
    """On the H200 in quick mode the roof was a 16 MiB copy (2 × 16 MiB fit in its 50 MB L2), under a text that says
    1 GiB, far larger than any L2."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    assert copy_bytes(GPU) == 2**30  # far beyond the largest L2 (a B200's 126 MB)
    assert copy_bytes(torch.device("cpu")) == 16 * 2**20  # quick mode on a CPU stays small


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
    scope = {"gpulab": gpulab, "torch": torch, "tqdm": tqdm, "pd": pd, "precision": precision, "flops": flops,
             "device": torch.device("cpu"), "precisions": ["fp32", "bf16"], "comparing": {}, "tf32": lambda p: None}
    exec(compile(code("04", "device copy"), "<lesson 04: matmul sweep>", "exec"), scope)
    assert ceiling.asked == ["fp32", "bf16"]  # one ceiling search per precision: the one section 3 divides by
    rows = scope["log"].frame()
    peaks = rows[rows["kind"] == "peak"].set_index("precision")
    assert peaks.loc["fp32", "tflops"] == 5.0 and peaks.loc["fp32", "sm_clock_mhz"] == 1234.0  # the peak's own span
    assert peaks.loc["fp32", ["m", "n", "k"]].tolist() == [256, 512, 128]  # the ceiling's fastest shape
    assert peaks.loc["bf16", "tflops"] == pytest.approx(4.0) and peaks.loc["bf16", "n"] == 128
    assert peaks.loc["bf16", "sm_clock_mhz"] == 1128.0  # the sweep's fastest matmul, and the state it ran in
    swept = rows[rows["kind"] == "matmul"]
    assert (swept["sm_clock_mhz"] == 1000.0 + swept["n"]).all()
    assert rows.loc[rows["kind"] == "copy", "sm_clock_mhz"].tolist() == [999.0]
    assert rows.loc[rows["kind"] == "speedup over fp32", "sm_clock_mhz"].tolist() == [777.0]
