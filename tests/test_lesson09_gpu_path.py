"""Lesson 09's cells on the paths a GPU takes, run here on the CPU with the GPU's answers injected: ceilings with the
clocks they ran at, MFU over the card's dense datasheet peak with "of achievable" beside it, a waterfall measured
against one reference peak, races whose timings, losses and machine states are given, CUDA graphs' memory pools,
causal attention's FLOPs, graph breaks without recompiles, FP8's three training matmuls, and the GPU-busy share of
each end of the waterfall. Nothing is asserted on a real timing; each test fails on the lesson as the first H200 run
found it (2026-11-27)."""

import ast
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import types
import warnings

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import Comparison, busy, datasheets, flops, racing, text
from gpulab.conditions import Conditions

from .conftest import ROOT

DATA = ROOT / "tests" / "data" / "lesson09"
H100 = "NVIDIA H100 80GB HBM3"
# Measured-looking ceilings (below the H100 SXM's dense peaks, as a card's steady best is), far apart per precision.
CEILINGS = {"fp32": 51.0, "tf32": 370.0, "fp16": 700.0, "bf16": 720.0}


def code(marker: str) -> str:
    """The source of the one code cell of lesson 09 that contains ``marker``."""
    nb = nbformat.read(ROOT / "notebooks" / "09_transformers.ipynb", as_version=4)
    found = [c.source for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, f"{len(found)} code cells of lesson 09 contain {marker!r}"
    return found[0]


def run(scope: dict, *markers: str) -> dict:
    """Run the lesson's cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
    for marker in markers:
        exec(compile(code(marker), f"<lesson 09: {marker}>", "exec"), scope)
    return scope


def define(scope: dict, marker: str, *names: str) -> dict:
    """Run only the top-level definitions of ``names`` (functions, classes, assignments) of the cell with ``marker``."""
    tree = ast.parse(code(marker))
    kept = [node for node in tree.body if getattr(node, "name", None) in names or any(
        isinstance(t, ast.Name) and t.id in names for t in getattr(node, "targets", []))]
    assert {getattr(n, "name", None) or n.targets[0].id for n in kept} == set(names)
    exec(compile(ast.Module(kept, type_ignores=[]), f"<lesson 09: {marker}>", "exec"), scope)
    return scope


def h100_ceilings(precisions=CEILINGS) -> dict:
    return {p: flops.Ceiling(p, CEILINGS[p], datasheet_tflops=datasheets.peak(H100, p)) for p in precisions}


@pytest.fixture
def lesson(monkeypatch, results_dir):
    """The notebook's globals after its imports and its model cell, in quick mode on this CPU; figures not shown."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "gpulab": gpulab}
    run(scope, "import gc", "class GPT(nn.Module)")
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
    lesson.update(on_gpu=True, info=info, capability=(9, 0))
    monkeypatch.setattr(flops, "device_info", lambda device: types.SimpleNamespace(tf32=True, name=H100))
    monkeypatch.setattr(flops, "reference_peak", lambda precisions, device=None: max(
        ((p, datasheets.peak(H100, p)) for p in precisions), key=lambda item: item[1]))
    return lesson


# ----- section 2: the ceilings, the peak, the first run's MFU -------------------------------------------------------

RUN_1128 = DATA / "2026-11-28-h200"
# A burst after a rest, at the top clock, per precision: not in the 2026-11-28 run (flops.ceiling did not time one
# then); bf16 within the 769-798 TFLOP/s a short burst of 8192³ products reached on these cards.
BURSTS = {"fp32": 55.0, "tf32": 400.0, "bf16": 790.0}


def h200_ceiling(precision: str) -> flops.Ceiling:
    """The H200's ceiling of 2026-11-28 as flops.ceiling gives it now: the run's sustained row (its clocks and power)
    and a burst at the top clock (``BURSTS``)."""
    row = pd.read_csv(RUN_1128 / "09_ceilings.csv").set_index("precision").loc[precision]
    held = Conditions(gpu=True, sm_clock_mhz=row.sm_clock_mhz, sm_clock_low_mhz=row.sm_clock_low_mhz,
                      sm_clock_high_mhz=row.sm_clock_high_mhz, sm_clock_max_mhz=row.sm_clock_max_mhz,
                      gpu_power_w=row.gpu_power_w, gpu_power_limit_w=row.gpu_power_limit_w, throttle=(row.throttle,))
    top = dataclasses.replace(held, sm_clock_mhz=1980.0, sm_clock_low_mhz=1980.0, sm_clock_high_mhz=1980.0,
                              gpu_power_w=640.0, throttle=())
    burst, sustained = flops.Timed(BURSTS[precision], top), flops.Timed(row.ceiling_tflops, held)
    chosen = burst if burst.tflops >= sustained.tflops else sustained  # as flops.ceiling chooses
    return flops.Ceiling(precision, chosen.tflops, (int(row.m), int(row.n), int(row.k)),
                         {(int(row.m), int(row.n), int(row.k)): row.ceiling_tflops}, "NVIDIA H200",
                         datasheets.peak("NVIDIA H200", precision), chosen.conditions, burst=burst, sustained=sustained)


def test_the_ceilings_table_shows_the_burst_and_the_sustained_rate_each_with_its_clock_and_power(
        on_an_h100, monkeypatch, capsys, results_dir):
    """The H200's bf16 row of 2026-11-28 ran at 1515 of 1980 MHz, 557 W of its 700 W limit, SW power cap (694.9
    TFLOP/s): the table shows that sustained rate with its clock and power beside the burst at the top clock, the
    ceiling "of achievable" divides by; what the gap is comes from those columns. fp16 and fp8, which no step of the
    lesson runs in, are not searched (each search takes seconds on a GPU). A burst that came out slower (tf32 here:
    its clocks had not come back) leaves the ceiling at the sustained rate, and the cell says so."""
    monkeypatch.setitem(BURSTS, "tf32", 300.0)
    asked = []
    monkeypatch.setattr(flops, "ceiling", lambda precision, device=None, **options: asked.append(precision) or
                        h200_ceiling(precision))
    monkeypatch.setattr(flops, "precisions_here", lambda device=None: ["fp32", "tf32", "fp16", "bf16", "fp8"])
    on_an_h100["info"] = dataclasses.replace(on_an_h100["info"], name="NVIDIA H200")
    run(on_an_h100, "ceiling_log = gpulab.ResultLog")
    assert asked == ["fp32", "tf32", "bf16"]
    table = next(d for d in on_an_h100["displayed"] if isinstance(d, pd.DataFrame)).set_index("precision")
    bf16 = table.loc["bf16"]
    assert (bf16["sustained"], bf16["sustained: SM clock (MHz)"], bf16["sustained: power (W)"],
            bf16["sustained: held by"]) == (694.866, "1515 MHz of 1980", "557 of 700", "SW power cap")
    assert (bf16["ceiling"], bf16["burst"], bf16["burst: SM clock (MHz)"]) == (790.0, 790.0, "1980 MHz of 1980")
    assert bf16["datasheet (dense)"] == 989.5 and bf16["of datasheet"] == pytest.approx(790 / 989.5, abs=1e-3)
    said = capsys.readouterr().out
    assert ("bf16: sustained 694.9 TFLOP/s at SM clock 1515 MHz of 1980, 557 W of 700, SW power cap: 12% below its "
            "burst, 790 TFLOP/s at SM clock 1980 MHz of 1980, 640 W of 700. Held at its power limit") in said
    assert "fp32: sustained 52.17 TFLOP/s at SM clock 1860–1965 MHz of 1980, 699 W of 700" in said
    assert "The ceiling column, what 'of achievable' divides by, is the burst" in said
    assert ("tf32: the burst, 300 TFLOP/s at SM clock 1980 MHz of 1980, 640 W of 700, was no faster than the "
            "sustained rate, 342.6 TFLOP/s at SM clock 1455–1485 MHz of 1980, 695 W of 700, SW power cap") in said
    assert table.loc["tf32", "ceiling"] == table.loc["tf32", "sustained"] == 342.635
    rows = pd.read_csv(results_dir / "09_ceilings.csv").set_index("precision")
    assert rows.loc["bf16", "sustained_sm_clock_low_mhz"] == 1515 and rows.loc["bf16", "ceiling_tflops"] == 790.0


def test_a_burst_no_faster_on_a_card_no_power_limit_held_is_not_said_to_have_lacked_its_clocks(
        on_an_h100, monkeypatch, capsys, results_dir):
    """A card whose search ran at its top clock, well under its power limit (an L4 or an A100 on fp32, say): burst and
    sustained differ by noise, and a burst that came out a little slower is not put down to clocks that "had not come
    back up" (they never fell); the ceiling is the sustained rate, as the last line says."""
    def unheld(precision):
        c = h200_ceiling(precision)
        free = dataclasses.replace(c.sustained.conditions, sm_clock_low_mhz=1980.0, sm_clock_high_mhz=1980.0,
                                   gpu_power_w=420.0, throttle=())
        sustained = flops.Timed(c.sustained.tflops, free)
        burst = flops.Timed(0.99 * sustained.tflops, c.burst.conditions)
        return dataclasses.replace(c, tflops=sustained.tflops, conditions=free, burst=burst, sustained=sustained)

    monkeypatch.setattr(flops, "ceiling", lambda precision, device=None, **options: unheld(precision))
    monkeypatch.setattr(flops, "precisions_here", lambda device=None: ["fp32", "tf32", "fp16", "bf16"])
    on_an_h100["info"] = dataclasses.replace(on_an_h100["info"], name="NVIDIA H200")
    run(on_an_h100, "ceiling_log = gpulab.ResultLog")
    said = capsys.readouterr().out
    assert "had not come back" not in said
    assert said.count("no power limit held the clocks down, and the ceiling is the faster of the two") == 3
    assert "is the burst, or the sustained rate where the burst came out no faster" in said


def test_the_first_run_prints_the_clock_its_steps_ran_at_beside_the_ceilings_two(on_an_h100, capsys, results_dir):
    """The evidence for dividing by the burst, as the H200 measured it on 2026-11-28: the first run's steps ran at
    1980 MHz, its top clock, at up to 668 W (under the limit), where the fp32 search ran at 1860-1965 MHz at 699 W."""
    first = pd.read_csv(RUN_1128 / "09_first_run.csv").iloc[0]
    state = Conditions(gpu=True, sm_clock_mhz=first.sm_clock_mhz, sm_clock_low_mhz=first.sm_clock_low_mhz,
                       sm_clock_high_mhz=first.sm_clock_high_mhz, sm_clock_max_mhz=first.sm_clock_max_mhz,
                       gpu_power_w=first.gpu_power_w, gpu_power_limit_w=first.gpu_power_limit_w)
    on_an_h100.update(first_step_s=first.step_s, per_token=first.flops_per_token, micro=int(first.micro_batch),
                      cfg=on_an_h100["GPTConfig"](seq_len=1024), first_tokens_per_s=first.tokens_per_s,
                      first_steps=60, curve=[{"loss": first.loss_start}, {"loss": first.loss_end}],
                      first_run_state=state, ceilings={"fp32": h200_ceiling("fp32")})
    define(on_an_h100, "ceiling_log = gpulab.ResultLog", "power")
    run(on_an_h100, "first_mfu = flops.mfu")
    said = capsys.readouterr().out
    assert (f"{flops.percent(first.achieved_tflops / 55.0)} of achievable (the fp32 ceiling measured here, 55)" in said)
    assert ("Its steps ran at SM clock 1980 MHz of 1980 (668 of 700 W); the fp32 burst ran at 1980 MHz of 1980, the "
            "sustained rate at 1860–1965 MHz of 1980 (699 of 700 W). Over the sustained rate the step would read "
            f"{flops.percent(first.achieved_tflops / first.ceiling_tflops)} of achievable.") in said


def test_the_first_runs_mfu_is_over_the_dense_peak_with_of_achievable_beside_it_and_its_row_carries_the_runs_state(
        on_an_h100, capsys, results_dir):
    """The H200's first run as it measured it (100.8 ms per step of 8 × 1024 tokens, 416.4 MFLOP per token): MFU over
    the dense fp32 peak of 67 TFLOP/s is 50.5 %, "of achievable" over its 51.9 TFLOP/s ceiling 65.2 % (the run printed
    the latter as its MFU); the results row carries the GPU's state over the run, not a snapshot at writing time."""
    first = pd.read_csv(DATA / "h200_09_first_run.csv").iloc[0]
    over_the_run = Conditions(gpu=True, sm_clock_mhz=1980, sm_clock_low_mhz=1965, sm_clock_high_mhz=1980,
                              sm_clock_max_mhz=1980)
    on_an_h100.update(first_step_s=first.step_s, per_token=first.flops_per_token, micro=int(first.micro_batch),
                      cfg=on_an_h100["GPTConfig"](seq_len=1024), first_tokens_per_s=first.tokens_per_s,
                      first_steps=100, curve=[{"loss": first.loss_start}, {"loss": first.loss_end}],
                      first_run_state=over_the_run,
                      ceilings={"fp32": flops.Ceiling("fp32", first.ceiling_tflops, datasheet_tflops=67.0)})
    run(on_an_h100, "first_mfu = flops.mfu")
    said = capsys.readouterr().out
    mfu, achievable = first.achieved_tflops / 67.0, first.achieved_tflops / first.ceiling_tflops
    assert (round(mfu, 3), round(achievable, 3)) == (0.505, 0.652)
    assert f"MFU {flops.percent(mfu)} (33.9 TFLOP/s of model FLOPs over the dense fp32 peak of 67)" in said
    assert f"{flops.percent(achievable)} of achievable (the fp32 ceiling measured here, 51.9)" in said
    row = pd.read_csv(results_dir / "09_first_run.csv").iloc[-1]
    assert row.sm_clock_low_mhz == 1965 and row.mfu == pytest.approx(0.505, abs=1e-3)


# ----- section 3: what a causal kernel computes ----------------------------------------------------------------------

def test_kernel_flops_counts_the_lower_triangle_of_causal_fused_attention_and_all_of_a_written_out_one(lesson):
    define(lesson, "def kernel_flops", "FUSED_ATTENTION", "kernel_flops")
    kernel_flops, T = lesson["kernel_flops"], 256
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
    fused = flops.count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    written = flops.count(lambda: lesson["manual_attention"](q, k, v).sum().backward())
    square = 14 * 2 * T * T * 16  # forward 2 matmuls, backward 5 (the scores recomputed), 2 FLOPs per multiply-add
    assert fused.total == square  # FlopCounterMode's upper bound: the whole T×T square
    assert kernel_flops(fused, T) == pytest.approx(square * (T + 1) / (2 * T))
    assert kernel_flops(written, T) == written.total  # written out, the masked half is computed too
    step = flops.Count(1000 + square, {"Global": {torch.ops.aten.mm: 1000,
                                                  torch.ops.aten._scaled_dot_product_cudnn_attention: square // 2,
                                                  torch.ops.aten._scaled_dot_product_cudnn_attention_backward:
                                                      square // 2}})
    assert kernel_flops(step, T) == pytest.approx(1000 + square * (T + 1) / (2 * T))


# ----- section 4: the waterfall ------------------------------------------------------------------------------------------

@pytest.fixture
def waterfall(lesson, monkeypatch):
    """The globals the waterfall's cells use: the text, the counted FLOPs per token, ceilings, the helpers. The
    compile cache folders the waterfall sets are the test's own, and restored after it."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    tokens = text.python_source(max_bytes=200_000)
    lesson["train_tokens"], lesson["val_tokens"] = text.split(tokens)
    lesson["cfg"] = lesson["GPTConfig"](**lesson["SIZE"])
    lesson["per_token"] = float(flops.gpt_flops_per_token(lesson["cfg"].n_layer, lesson["cfg"].n_embd,
                                                           lesson["cfg"].seq_len, text.VOCAB))
    lesson["ceilings"] = h100_ceilings()
    define(lesson, "def peak_bytes", "peak_bytes")
    define(lesson, "def kernel_flops", "FUSED_ATTENTION", "kernel_flops")
    return run(lesson, "def run_steps", "def graph_pool_bytes", "def measured(result, options)")


def snapshot(pools: dict) -> list:
    """The H200 snapshot's segments (default pool) and one segment per CUDA graphs' pool of ``pools`` bytes."""
    segments = json.loads((DATA / "h200_snapshot_segments.json").read_text())["segments"]
    return segments + [{**segments[0], "total_size": size, "segment_pool_id": [pool, 0]} for pool, size in pools.items()]


def test_cuda_graphs_pools_count_in_the_step_peak(waterfall, monkeypatch):
    """A replayed step allocates almost nothing (the H200 printed 0.126 MiB for its CUDA graphs step): its activations
    live in the graphs' private pool, which the step's peak now counts; the default pool of a real snapshot is not."""
    pools = {}
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot(pools))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    waterfall.update(on_gpu=True, peak_bytes=lambda one_step: 0.126 * 2**20)
    assert waterfall["graph_pool_bytes"]() == 0  # the real snapshot: every segment in the default pool (0, 0)
    before = waterfall["graph_pool_bytes"]()
    pools[1] = 48 * 2**20  # recorded during the race
    graphs = waterfall["step_peak_mib"](None, {"compile": "reduce-overhead"}, before)
    compiled = waterfall["step_peak_mib"](None, {"compile": "default"}, before)
    assert graphs == pytest.approx(48.126) and compiled == pytest.approx(0.126)


def test_a_race_compares_training_losses_step_by_step_a_measure_that_can_change(waterfall):
    """Both sides train on the same batches from the same weights: bf16 arithmetic moves the losses a little (the
    held-out loss the H200 run compared was the same to the last bit across six steps); a broken step shows at once."""
    race = waterfall["race"]
    bf16 = race(("fp32", {}), ("bf16", {"amp": True}))
    assert len(bf16.steps) == 2 and 0 < bf16.loss_gap < 0.05 and waterfall["same_training"](bf16)
    assert bf16.losses[0] != bf16.losses[1]
    waterfall["ATTENTION"]["broken"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) * math.inf
    broken = race(("fp32", {}), ("broken", {"attention": "broken"}))
    assert not waterfall["same_training"](broken)
    faster = dataclasses.replace(Comparison.of([2.0] * 6, [1.0] * 6, labels=("fp32", "broken")), candidate_warmup=(1.0,))
    judged = racing.Path(lambda current, candidate: dataclasses.replace(broken, comparison=faster),
                         judge=lambda result: None if waterfall["same_training"](result) else "loss differs",
                         row=waterfall["measured"], current=("fp32", {}))
    row = judged.step("broken", {"attention": "broken"})
    assert row["note"] == "loss differs" and not row["kept"] and row["tokens_per_s"] > 0


def run_waterfall(waterfall, times, gaps=None, warmups=None, states=None, stop_at=None):
    """The waterfall's cell with its races' results given; each race records its candidate's options and the folder
    Inductor would compile into. The race of step ``stop_at`` raises, as a crash or an interrupt would."""
    seen = []

    def race(current, candidate):
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
        return waterfall["Race"](comparison, gap, (4.2, 4.2 + gap), (10.0, 8.0), ("naive step", "final step"))

    waterfall["race"] = race
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
    path = waterfall["path"].set_index("step")
    assert waterfall["reference_precision"] == "bf16" and waterfall["reference_tflops"] == datasheets.peak(H100, "bf16")
    naive, bf16 = path.loc["naive fp32"], path.loc["autocast bfloat16"]
    assert (naive.precision, bf16.precision) == ("fp32", "bf16")
    assert bf16.mfu < naive.mfu and bf16.mfu_vs_reference > naive.mfu_vs_reference
    measured = path[path.tokens_per_s.notna()]
    ratio = measured.mfu_vs_reference / measured.tokens_per_s
    assert ratio.max() == pytest.approx(ratio.min())  # one denominator: MFU vs the reference ∝ tokens/s
    assert measured.of_achievable.to_numpy() == pytest.approx(
        (measured.achieved_tflops / measured.precision.map(CEILINGS)).to_numpy())
    rows = pd.read_csv(results_dir / "09_waterfall.csv").set_index("step")
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
    folder = waterfall["compile_caches"].name
    assert {cache for *_, cache in seen} == {folder} and os.environ["TRITON_CACHE_DIR"].startswith(folder)
    run(waterfall, "final = race((")
    assert "30.0 s to compile, cold (empty Inductor and Triton caches)" in capsys.readouterr().out
    run_waterfall(waterfall, STEP_TIMES, warmups={"torch.compile": 30.0})
    run(waterfall, "final = race((")
    assert "warm (this kernel compiled before" in capsys.readouterr().out
    assert waterfall["compile_caches"].name == folder == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_a_waterfall_stopped_mid_path_has_logged_every_verdict_it_gave(on_an_h100, waterfall, results_dir):
    """The 2026-11-28 H200 run stopped at the CUDA graphs step and kept no waterfall row: they were logged after the
    loop. Each row is logged as its verdict is given (racing.Path's log): stopped at torch.compile, the naive loop and
    the six steps before it are in 09_waterfall.csv, each with its verdict, its race's state and the one reference."""
    states = {name: Conditions(gpu=True, sm_clock_mhz=1000 + i, sm_clock_low_mhz=1000 + i, sm_clock_high_mhz=1000 + i)
              for i, name in enumerate(STEP_TIMES)}
    with pytest.raises(KeyboardInterrupt, match="stopped at torch.compile"):
        run_waterfall(waterfall, STEP_TIMES, states=states, stop_at="torch.compile")
    rows = pd.read_csv(results_dir / "09_waterfall.csv").set_index("step")
    assert list(rows.index) == list(STEP_TIMES)[:7]
    assert rows.note.tolist() == ["the baseline", "kept", "kept", "kept", "within noise", "within noise", "kept"]
    assert rows.loc["naive fp32", "sm_clock_mhz"] == rows.loc["TF32", "sm_clock_mhz"] == 1001
    reference = datasheets.peak(H100, "bf16")
    assert rows.mfu_vs_reference.to_numpy() == pytest.approx((rows.achieved_tflops / reference).to_numpy())
    assert (rows.reference == f"the dense bf16 peak ({reference:g} TFLOP/s)").all()


def test_a_step_whose_training_drifts_is_not_kept_however_fast(on_an_h100, waterfall):
    run_waterfall(waterfall, STEP_TIMES, gaps={"vocabulary 257 → 320": 0.4, "fused AdamW": math.nan})
    path = waterfall["path"].set_index("step")
    assert path.loc["vocabulary 257 → 320", "note"] == "loss differs" and not path.loc["fused AdamW", "kept"]
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
    run(waterfall, "final = race((")
    said = capsys.readouterr().out
    assert "30.0 s to compile, cold" in said and "not faster beyond the noise" in said and "pays for itself" not in said
    run_waterfall(waterfall, STEP_TIMES, warmups={"torch.compile": 30.0})
    run(waterfall, "final = race((")
    said = capsys.readouterr().out
    c = waterfall["races"]["torch.compile"].comparison
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
    run(waterfall, "final = race((", "busy.measure(")
    assert profiled == [("naive step", "naive fp32"), ("final step", "CUDA graphs (final)")]
    said = capsys.readouterr().out
    assert str(measure("naive step", label="naive fp32")) in said and "NVML utilisation: time in which any" in said
    rows = pd.read_csv(results_dir / "09_gpu_busy.csv")
    assert list(rows.kernel_busy) == [0.99, 0.93] and rows.mfu_vs_reference.is_monotonic_increasing


def test_the_wrong_ways_demo_divides_by_this_cards_peak_and_names_another_cards_as_wrong(on_an_h100, lesson):
    """On the H200 the lesson fell back to the H100's figure; now the right row is the H200's own dense bf16 peak, and
    the wrong ones are another precision's, a sparse figure and another card's (the A100's: nanoGPT's 104 %)."""
    sheet = datasheets.find("NVIDIA H200")
    final_u = flops.mfu(3e14, 0.9, {"bf16": flops.Ceiling("bf16", 720.0, datasheet_tflops=sheet.tflops["bf16"])},
                        precision="bf16")
    lesson.update(sheet=sheet, final_u=final_u, ceilings={"bf16": flops.Ceiling("bf16", 720.0)})
    run(lesson, "divisors = ")
    table = lesson["displayed"][-1].set_index("divided by")["TFLOP/s"]
    assert table["right (MFU): this card's dense bf16 peak"] == datasheets.peak("NVIDIA H200", "bf16")
    assert table["another card's dense bf16 peak (A100 SXM 80GB)"] == 312.0
    assert table["a 'with sparsity' bf16 figure (twice the dense one)"] == 2 * sheet.tflops["bf16"]
    assert table["another precision's peak of this card (tf32)"] == sheet.tflops["tf32"]


# ----- section 5: graph breaks without recompiles --------------------------------------------------------------------

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
    lesson.update(on_gpu=True, STEP_BASE={"micro": 2}, cfg=lesson["small_cfg"], PAIRS=5)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run(lesson, 'counters["stats"]')
    assert "Graphs compiled: with breaks 2, fixed 1; during the race 0." in capsys.readouterr().out
    row = pd.read_csv(results_dir / "09_graph_breaks.csv").iloc[-1]
    assert (row.graphs_with_breaks, row.graphs_fixed, row.recompiled_during_race) == (2, 1, 0)


# ----- section 6: HFU of checkpointing -----------------------------------------------------------------------------------

def test_checkpointing_hfu_counts_what_the_causal_kernels_run(waterfall, results_dir):
    """FlopCounterMode's upper bound made the step without checkpointing run more than the model's FLOPs (1.02 on the
    H200); counted as the causal kernels run it, it runs fewer, and checkpointing adds its recomputation."""
    run(waterfall, "ckpt_vs = gpulab.compare")
    rows = pd.read_csv(results_dir / "09_checkpointing.csv").set_index("config")
    assert rows.loc["no checkpointing", "hardware_over_model"] < 1 < rows.loc["checkpointed blocks", "hardware_over_model"]


# ----- section 7: FP8's three training matmuls ---------------------------------------------------------------------------

@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """torch._scaled_mm, checked for the layouts and fp8 types a GPU requires, its calls recorded."""
    calls, real = [], torch._scaled_mm

    def scaled_mm(a, b, scale_a, scale_b, out_dtype=None):
        assert a.is_contiguous() and b.t().is_contiguous(), "a row-major, b column-major"
        assert (a.dtype, b.dtype) != (torch.float8_e5m2, torch.float8_e5m2)
        assert scale_a.dtype == scale_b.dtype == torch.float32
        calls.append((a.dtype, b.dtype))
        return real(a, b, scale_a, scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    return calls


def test_fp8_runs_the_three_matmuls_of_training_each_scaled_and_close_to_bf16(lesson, scaled_mm_calls):
    """The H200 run timed one forward matmul, its scaling eager and unfused; a linear layer trains with three."""
    run(lesson, "class Float8Matmul")
    fp8, bf16 = (lesson["training_matmuls"](64, fp8=kind) for kind in (True, False))
    got, expected = fp8(), bf16()
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert scaled_mm_calls == [(e4m3, e4m3), (e5m2, e4m3), (e5m2, e4m3)]  # forward, the input's and weight's grads
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.linalg.norm((a - b).float()) / torch.linalg.norm(b.float()) < 0.15


def test_the_fp8_crossover_on_a_gpus_path_times_forward_and_both_gradients(lesson, scaled_mm_calls, capsys,
                                                                          results_dir, monkeypatch):
    lesson.update(on_gpu=True, capability=(9, 0), by_mode=lambda full, quick: [64, 128] if isinstance(quick, list) else quick)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run(lesson, "class Float8Matmul")
    rows = pd.read_csv(results_dir / "09_fp8.csv")
    assert list(rows.n) == [64, 128] and (rows.recipe == "Float8Matmul (compiled scaling)").all()
    assert (rows.rel_error_grad_weight < 0.15).all()
    assert "fp8's three training matmuls (scaling included)" in capsys.readouterr().out


def test_the_fp8_crossover_uses_torchaos_recipe_where_torchao_is_installed(lesson, monkeypatch):
    converted = []

    def convert_to_float8_training(module, **options):
        converted.append(module)
        return module

    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", types.SimpleNamespace(
        convert_to_float8_training=convert_to_float8_training))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run(lesson, "class Float8Matmul")
    out, grad_x, grad_w = lesson["training_matmuls"](32, fp8=True)()
    assert len(converted) == 1 and isinstance(converted[0][0], torch.nn.Linear)
    assert out.shape == grad_x.shape == grad_w.shape == (32, 32)


def test_the_waterfall_plot_says_what_a_kept_step_kept(lesson):
    """plots.waterfall's legend names what the lesson keeps (the same training), the old label by default."""
    ax = gpulab.plots.waterfall(["a", "b"], [1.5, 0.9], kept=[True, False], accuracy_lost=[False, True],
                                lost_label="its training losses differ", kept_label="kept: faster, the same training")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "kept: faster, the same training" and labels[2] == "dropped: its training losses differ"
    ax = gpulab.plots.waterfall(["a"], [1.5])
    assert ax.get_legend().get_texts()[0].get_text() == "kept: faster, accuracy kept"
