"""Lesson 10's cells on the paths a GPU takes, run here on the CPU with the GPU's answers injected: a waterfall
measured against one reference peak, races whose timings, losses and machine states are given, CUDA graphs' memory
pools, the compiler steps compiled cold, each end's GPU-busy share, MFU divided the wrong ways, and graph breaks
without recompiles. The race plumbing is gpulab.step_races; the training step and its switches are the lesson's cells.
Nothing is asserted on a real timing; each test fails on the lesson as the first H200 run found it (2026-11-27) or
as the 2026-11-28 run stopped."""

import dataclasses
import functools
import json
import math
import os
import statistics
import types
import warnings

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import Comparison, busy, datasheets, flops, racing, step_races, text
from gpulab.conditions import Conditions

from .conftest import ROOT
from .lesson_cells import Cells

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)

LESSON = Cells("10_gpt_made_fast.ipynb")
code, run, define = LESSON.code, LESSON.run, LESSON.define
DATA = ROOT / "tests" / "data" / "lesson09"  # the 2026-11-28 H200 run of lesson 09 (the waterfall was its section 4)
H100 = "NVIDIA H100 80GB HBM3"
# Measured-looking ceilings (below the H100 SXM's dense peaks, as a card's steady best is), far apart per precision.
CEILINGS = {"fp32": 51.0, "tf32": 370.0, "fp16": 700.0, "bf16": 720.0}
HEAD_TO_HEAD, BREAK_EVEN = "final = waterfall.race_ends()", '"torch.compile" in waterfall.races'


def h100_ceilings(precisions=CEILINGS) -> dict:
    return {p: flops.Ceiling(p, CEILINGS[p], datasheet_tflops=datasheets.peak(H100, p)) for p in precisions}


@pytest.fixture
def lesson(monkeypatch, results_dir):
    """The notebook's globals after its imports, in quick mode on this CPU; figures not shown."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "gpulab": gpulab}
    run(scope, 'plans.lesson("10")', "import itertools")
    scope["displayed"] = []
    scope["display"] = scope["displayed"].append
    yield scope
    torch.set_float32_matmul_precision(before)
    torch._dynamo.reset()
    plt.close("all")


@pytest.fixture
def on_an_h100(lesson, monkeypatch):
    """The lesson sees an H100 SXM (TF32, bf16, its datasheet row) while its work runs on this CPU."""
    info = dataclasses.replace(lesson["info"], name=H100, tf32=True, bf16_native=True, compute_capability=(9, 0))
    lesson.update(on_gpu=True, info=info, sheet=datasheets.find(H100))
    card = types.SimpleNamespace(tf32=True, name=H100)
    monkeypatch.setattr(flops, "device_info", lambda device: card)
    monkeypatch.setattr(step_races, "device_info", lambda device: card)
    monkeypatch.setattr(flops, "reference_peak", lambda precisions, device=None: max(
        ((p, datasheets.peak(H100, p)) for p in precisions), key=lambda item: item[1]))
    return lesson


# ----- section 2: the waterfall ------------------------------------------------------------------------------------------

@pytest.fixture
def waterfall(lesson, monkeypatch):
    """The globals the waterfall's cells use: the text, the counted FLOPs per token, ceilings, the training step and
    its switches. The compile cache folders the waterfall sets are the test's own, and restored after it."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    tokens = text.python_source(max_bytes=200_000)
    lesson["train_tokens"], _ = text.split(tokens)
    lesson["cfg"] = lesson["GPTConfig"](**lesson["SIZE"])
    lesson["per_token"] = float(flops.gpt_flops_per_token(lesson["cfg"].n_layer, lesson["cfg"].n_embd,
                                                           lesson["cfg"].seq_len, text.VOCAB))
    lesson["ceilings"] = h100_ceilings()
    lesson["_monkeypatch"] = monkeypatch  # run_waterfall's races stay given for the rest of the test
    return run(lesson, "def run_steps", "cpu_quick = ")


def snapshot(pools: dict) -> list:
    """The H200 snapshot's segments (default pool) and one segment per CUDA graphs' pool of ``pools`` bytes."""
    segments = json.loads((DATA / "h200_snapshot_segments.json").read_text())["segments"]
    return segments + [{**segments[0], "total_size": size, "segment_pool_id": [pool, 0]} for pool, size in pools.items()]


def test_cuda_graphs_pools_count_in_the_step_peak(monkeypatch):
    """A replayed step allocates almost nothing (the H200 printed 0.126 MiB for its CUDA graphs step): its activations
    live in the graphs' private pool, which the step's peak now counts; the default pool of a real snapshot is not."""
    pools = {}
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot(pools))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(step_races, "on_gpu", lambda device=None: True)
    monkeypatch.setattr(step_races, "peak_bytes", lambda one_step, device=None: 0.126 * 2**20)
    assert step_races.graph_pool_bytes() == 0  # the real snapshot: every segment in the default pool (0, 0)
    before = step_races.graph_pool_bytes()
    pools[1] = 48 * 2**20  # recorded during the race
    graphs = step_races.step_peak_mib(None, {"compile": "reduce-overhead"}, before)
    compiled = step_races.step_peak_mib(None, {"compile": "default"}, before)
    assert graphs == pytest.approx(48.126) and compiled == pytest.approx(0.126)


def test_a_race_compares_training_losses_step_by_step_a_measure_that_can_change(waterfall, monkeypatch):
    """Both sides train on the same batches from the same weights: bf16 arithmetic moves the losses a little (the
    held-out loss the H200 run compared was the same to the last bit across six steps); a broken step shows at once."""
    run_steps = waterfall["run_steps"]
    bf16 = step_races.race(run_steps, ("fp32", {}), ("bf16", {"amp": True}))
    assert len(bf16.steps) == 2 and 0 < bf16.loss_gap < 0.05 and step_races.same_training(bf16)
    assert bf16.losses[0] != bf16.losses[1]
    monkeypatch.setitem(text.ATTENTION, "broken",
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) * math.inf)
    broken = step_races.race(run_steps, ("fp32", {}), ("broken", {"attention": "broken"}))
    assert not step_races.same_training(broken) and step_races.judge(broken) == racing.LOSSES_DIFFER
    faster = dataclasses.replace(Comparison.of([2.0] * 6, [1.0] * 6, labels=("fp32", "broken")), candidate_warmup=(1.0,))
    meter = step_races.Meter(1e9, waterfall["ceilings"], waterfall["step_precision"],
                             step_races.Reference("fp32", 51.0, "the fp32 ceiling"))
    judged = step_races.Waterfall(lambda current, candidate: dataclasses.replace(broken, comparison=faster), meter,
                                  tokens_per_step=waterfall["tokens_per_step"], log="10_waterfall")
    row = judged.step("broken", {"attention": "broken"})
    assert row["note"] == racing.LOSSES_DIFFER and not row["kept"] and row["tokens_per_s"] > 0


def run_waterfall(waterfall, times, gaps=None, warmups=None, states=None, stop_at=None):
    """The waterfall's cell with its races' results given (``step_races.race`` replaced); each race records its
    candidate's options and the folder Inductor would compile into. The race of step ``stop_at`` raises, as a crash or
    an interrupt would. The lesson sees a GPU: the compile steps compile cold."""
    seen = []

    def race(run_steps, current, candidate, **options):
        (name_a, _), (name_b, options_b) = current, candidate
        if name_b == stop_at:
            raise KeyboardInterrupt(f"stopped at {name_b}")
        seen.append((name_b, dict(options_b), os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")))
        a, b = times[name_a.removesuffix(" (final)")], times[name_b.removesuffix(" (final)")]
        comparison = Comparison.of([a * (1 + 0.01 * i) for i in range(6)], [b * (1 - 0.01 * i) for i in range(6)],
                                   labels=(name_a, name_b), conditions=(states or {}).get(name_b))
        comparison = dataclasses.replace(comparison, candidate_warmup=(b + (warmups or {}).get(name_b, 0.0),),
                                         baseline_warmup=(a,))
        gap = (gaps or {}).get(name_b, 1e-3)
        return step_races.Race(comparison, gap, (4.2, 4.2 + gap), (10.0, 8.0), ("naive step", "final step"))

    waterfall["_monkeypatch"].setattr(step_races, "race", race)  # the head-to-head cell's race too
    waterfall["_monkeypatch"].setattr(step_races, "on_gpu", lambda device=None: True)
    run(waterfall, "torch.compiler.reset()  # no compiled code")
    return seen


STEP_TIMES = {"naive fp32": 1.0, "TF32": 0.5, "autocast bfloat16": 0.2, "SDPA": 0.15, "vocabulary 257 → 320": 0.15,
              "fused AdamW": 0.148, "micro-batch 4 × 1": 0.12, "torch.compile": 0.1, "CUDA graphs": 0.08}


def test_the_waterfall_shows_every_step_against_one_reference_peak(on_an_h100, waterfall, results_dir):
    """fp32 → TF32 → bf16: each precision's own dense peak is another denominator, so the bf16 step, five times the
    naive step's tokens/s, shows a lower MFU of its own peak than the naive step of its own; against one reference,
    the bf16 peak, the curve follows tokens/s. Each results row carries the state of its own race."""
    states = {name: Conditions(gpu=True, sm_clock_mhz=1000 + i, sm_clock_low_mhz=1000 + i, sm_clock_high_mhz=1000 + i)
              for i, name in enumerate(STEP_TIMES)}
    run_waterfall(waterfall, STEP_TIMES, states=states)
    path = waterfall["waterfall"].frame().set_index("step")
    reference = waterfall["meter"].reference
    assert (reference.precision, reference.tflops) == ("bf16", datasheets.peak(H100, "bf16"))
    naive, bf16 = path.loc["naive fp32"], path.loc["autocast bfloat16"]
    assert (naive.precision, bf16.precision) == ("fp32", "bf16")
    assert bf16.mfu < naive.mfu and bf16.mfu_vs_reference > naive.mfu_vs_reference
    measured = path[path.tokens_per_s.notna()]
    ratio = measured.mfu_vs_reference / measured.tokens_per_s
    assert ratio.max() == pytest.approx(ratio.min())  # one denominator: MFU vs the reference ∝ tokens/s
    assert measured.of_achievable.to_numpy() == pytest.approx(
        (measured.achieved_tflops / measured.precision.map(CEILINGS)).to_numpy())
    rows = pd.read_csv(results_dir / "10_waterfall.csv").set_index("step")
    assert rows.loc["TF32", "sm_clock_mhz"] == 1001 and rows.loc["naive fp32", "sm_clock_mhz"] == 1001
    assert rows.loc["CUDA graphs", "sm_clock_mhz"] == 1008
    assert (rows.reference == f"the dense bf16 peak ({datasheets.peak(H100, 'bf16'):g} TFLOP/s)").all()


def test_the_compiler_steps_come_last_and_compile_cold_once_each(on_an_h100, waterfall, capsys, monkeypatch):
    """A shape change after torch.compile would compile again: the padded vocabulary and the larger micro-batch come
    before it, so the waterfall compiles twice (compile, CUDA graphs). They compile into an empty cache folder (the
    H200 run's caches were warm on disk), kept for the kernel; a second run of the cell says it was warm."""
    monkeypatch.setattr(busy, "measure", lambda *args, **kwargs: busy.Busy(kwargs["label"]))
    seen = run_waterfall(waterfall, STEP_TIMES, warmups={"torch.compile": 30.0})
    names = [name for name, _, _ in seen]
    first_compiled = next(i for i, (_, options, _) in enumerate(seen) if options.get("compile"))
    shapes = [(o.get("padded_vocab"), o.get("micro")) for _, o, _ in seen[first_compiled:]]
    assert len(set(shapes)) == 1, (names, shapes)
    assert names[first_compiled:] == ["torch.compile", "CUDA graphs"]
    folder = step_races._caches[-1].name
    assert {cache for *_, cache in seen} == {folder} and os.environ["TRITON_CACHE_DIR"].startswith(folder)
    run(waterfall, HEAD_TO_HEAD, BREAK_EVEN)
    assert "30.0 s to compile, cold (empty Inductor and Triton caches)" in capsys.readouterr().out
    run_waterfall(waterfall, STEP_TIMES, warmups={"torch.compile": 30.0})
    run(waterfall, HEAD_TO_HEAD, BREAK_EVEN)
    assert "warm (this kernel compiled before" in capsys.readouterr().out
    assert step_races._caches[-1].name == folder == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_a_waterfall_stopped_mid_path_has_logged_every_verdict_it_gave(on_an_h100, waterfall, results_dir):
    """The 2026-11-28 H200 run stopped at the CUDA graphs step and kept no waterfall row: they were logged after the
    loop. Each row is logged as its verdict is given (racing.Path's log): stopped at torch.compile, the naive loop and
    the six steps before it are in 10_waterfall.csv, each with its verdict, its race's state and the one reference."""
    states = {name: Conditions(gpu=True, sm_clock_mhz=1000 + i, sm_clock_low_mhz=1000 + i, sm_clock_high_mhz=1000 + i)
              for i, name in enumerate(STEP_TIMES)}
    with pytest.raises(KeyboardInterrupt, match="stopped at torch.compile"):
        run_waterfall(waterfall, STEP_TIMES, states=states, stop_at="torch.compile")
    rows = pd.read_csv(results_dir / "10_waterfall.csv").set_index("step")
    assert list(rows.index) == list(STEP_TIMES)[:7]
    assert rows.note.tolist() == ["the baseline", "kept", "kept", "kept", "within noise", "within noise", "kept"]
    assert rows.loc["naive fp32", "sm_clock_mhz"] == rows.loc["TF32", "sm_clock_mhz"] == 1001
    reference = datasheets.peak(H100, "bf16")
    assert rows.mfu_vs_reference.to_numpy() == pytest.approx((rows.achieved_tflops / reference).to_numpy())
    assert (rows.reference == f"the dense bf16 peak ({reference:g} TFLOP/s)").all()


def test_a_step_whose_training_drifts_is_not_kept_however_fast(on_an_h100, waterfall):
    run_waterfall(waterfall, STEP_TIMES, gaps={"vocabulary 257 → 320": 0.4, "fused AdamW": math.nan})
    path = waterfall["waterfall"].frame().set_index("step")
    assert path.loc["vocabulary 257 → 320", "note"] == racing.LOSSES_DIFFER and not path.loc["fused AdamW", "kept"]
    assert path.loc["SDPA", "kept"] and path.loc["SDPA", "loss_gap"] == pytest.approx(1e-3)


def test_inductors_tf32_hint_is_explained_where_it_would_show(on_an_h100, waterfall, capsys):
    """TF32 measured within noise: torch.compile compiles fp32 matmuls with TF32 off, which Inductor flags."""
    slow_tf32 = {**STEP_TIMES, "TF32": 1.0, "autocast bfloat16": 1.0}
    run_waterfall(waterfall, slow_tf32)
    said = capsys.readouterr().out
    assert "torch.compile: its matmuls stay in full fp32, as the TF32 step was not kept here" in said


def test_the_break_even_is_computed_only_from_a_compile_step_faster_beyond_the_noise(on_an_h100, waterfall, capsys,
                                                                                       monkeypatch):
    monkeypatch.setattr(busy, "measure", lambda *args, **kwargs: busy.Busy(kwargs["label"]))
    run_waterfall(waterfall, {**STEP_TIMES, "torch.compile": 0.12}, warmups={"torch.compile": 30.0})
    run(waterfall, HEAD_TO_HEAD, BREAK_EVEN)
    said = capsys.readouterr().out
    assert "30.0 s to compile, cold" in said and "not faster beyond the noise" in said and "pays for itself" not in said
    run_waterfall(waterfall, STEP_TIMES, warmups={"torch.compile": 30.0})
    run(waterfall, HEAD_TO_HEAD, BREAK_EVEN)
    said = capsys.readouterr().out
    c = waterfall["waterfall"].races["torch.compile"].comparison
    saved = statistics.median(c.baseline_times) - statistics.median(c.candidate_times)
    startup = c.candidate_warmup[0] - statistics.median(c.candidate_times)
    assert f"{saved * 1e3:.2f} ms saved per step: it pays for itself after {startup / saved:,.0f} steps" in said


def test_the_gpu_busy_share_of_each_end_comes_from_its_own_steps(on_an_h100, waterfall, capsys, monkeypatch,
                                                                 results_dir):
    """busy.measure of the naive and of the final configuration, each profiling its own steps (the race's step
    functions), not NVML means over epochs; NVML's utilisation beside it with its meaning."""
    profiled = []

    def measure(step, *, label, **options):
        profiled.append((step, label))
        kernels = {"naive fp32": 0.99, "CUDA graphs (final)": 0.93}[label]
        return busy.Busy(label, steps=5, step_ms=100.0, kernel_share=kernels, busy_share=kernels, nvml_util=1.0)

    monkeypatch.setattr(busy, "measure", measure)
    run_waterfall(waterfall, STEP_TIMES)
    run(waterfall, HEAD_TO_HEAD, "busy.measure(")
    assert profiled == [("naive step", "naive fp32"), ("final step", "CUDA graphs (final)")]
    said = capsys.readouterr().out
    assert str(measure("naive step", label="naive fp32")) in said and "NVML utilisation: time in which any" in said
    rows = pd.read_csv(results_dir / "10_gpu_busy.csv")
    assert list(rows.kernel_busy) == [0.99, 0.93] and rows.mfu_vs_reference.is_monotonic_increasing


def wrong_ways(lesson, card: str, precision: str, flops_per_step: float, ceiling_tflops: float):
    """The wrong-ways cell run for ``card``'s sheet and a final step of ``flops_per_step`` in 0.9 s: (the sheet, the
    table's TFLOP/s by divisor)."""
    sheet = datasheets.find(card)
    ceiling = flops.Ceiling(precision, ceiling_tflops, datasheet_tflops=sheet.tflops[precision])
    lesson.update(sheet=sheet, final_u=flops.mfu(flops_per_step, 0.9, {precision: ceiling}, precision=precision))
    run(lesson, "divisors = ")
    return sheet, lesson["displayed"][-1].set_index("divided by")["TFLOP/s"]


def test_the_wrong_ways_demo_divides_by_this_cards_peak_and_names_another_cards_as_wrong(on_an_h100, lesson):
    """On the H200 the lesson fell back to the H100's figure; now the right row is the H200's own dense bf16 peak, and
    the wrong ones are another precision's, a sparse figure and another card's (the A100's: nanoGPT's 104 %)."""
    sheet, table = wrong_ways(lesson, "NVIDIA H200", "bf16", 3e14, 720.0)
    assert table["right (MFU): this card's dense bf16 peak"] == datasheets.peak("NVIDIA H200", "bf16")
    assert table["another card's dense bf16 peak (A100 SXM 80GB)"] == 312.0
    assert table["a 'with sparsity' bf16 figure (twice the dense one)"] == 2 * sheet.tflops["bf16"]
    assert table["another precision's peak of this card (tf32)"] == sheet.tflops["tf32"]


def test_a_t4_shows_no_sparse_figure_it_does_not_have(on_an_h100, lesson, capsys):
    """2:4 sparse tensor cores start with Ampere (sm_80): a T4 (sm_75) has no 'with sparsity' rate, and the lesson
    showed one (twice its fp16 peak) and says now that it has none."""
    _, table = wrong_ways(lesson, "Tesla T4", "fp16", 3e13, 40.0)
    assert table["right (MFU): this card's dense fp16 peak"] == 65.0
    assert not any("sparsity" in row for row in table.index)
    assert "The T4 has no 2:4 sparse tensor cores (sm_80 and newer)" in capsys.readouterr().out


# ----- section 3: graph breaks without recompiles --------------------------------------------------------------------

def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_the_chatty_and_quiet_blocks_compile_once_so_a_race_measures_graph_breaks(lesson):
    """The H200 run hit Dynamo's recompile_limit (8): the blocks kept Python floats (and a growing list) on themselves,
    values Dynamo guards, so every call compiled again. Called twelve times, each compiles its graphs once."""
    run(lesson, "class ChattyBlock")
    for kind, graphs in (("ChattyBlock", 2), ("QuietBlock", 1)):
        torch._dynamo.reset()
        block = torch.compile(lesson[kind](lesson["small_cfg"]), backend="eager")
        before = graphs_compiled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(12):
                block(torch.randn(2, lesson["small_cfg"].seq_len, lesson["small_cfg"].n_embd)).sum().backward()
        assert graphs_compiled() - before == graphs, kind
        assert not [w for w in caught if "list.append" in str(w.message)]  # Dynamo's warning on the H200: no cause left


def test_the_graph_break_race_reports_the_graphs_and_no_recompile_during_it(lesson, capsys, results_dir,
                                                                           monkeypatch):
    """The race's cell on a GPU's path (compiled with Dynamo's eager backend here)."""
    run(lesson, "class ChattyBlock")
    lesson.update(on_gpu=True, STEP_BASE={"micro": 2}, cfg=lesson["small_cfg"])
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run(lesson, 'counters["stats"]')
    assert "Graphs compiled: with breaks 2, fixed 1; during the race 0." in capsys.readouterr().out
    row = pd.read_csv(results_dir / "10_graph_breaks.csv").iloc[-1]
    assert (row.graphs_with_breaks, row.graphs_fixed, row.recompiled_during_race) == (2, 1, 0)


def test_the_waterfall_plot_says_what_a_kept_step_kept(lesson):
    """plots.waterfall's legend names what the lesson keeps (the same training), the old label by default."""
    ax = gpulab.plots.waterfall(["a", "b"], [1.5, 0.9], kept=[True, False], accuracy_lost=[False, True],
                                lost_label="its training losses differ", kept_label="kept: faster, the same training")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "kept: faster, the same training" and labels[2] == "dropped: its training losses differ"
    ax = gpulab.plots.waterfall(["a"], [1.5])
    assert ax.get_legend().get_texts()[0].get_text() == "kept: faster, accuracy kept"
