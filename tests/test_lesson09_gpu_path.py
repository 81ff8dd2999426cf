"""Lesson 09's cells on the paths a GPU takes, run here on the CPU with the GPU's answers injected: ceilings with the
clocks they ran at, the first run's MFU over the card's dense datasheet peak of its own precision with "of achievable"
and the 16-bit peak beside it, parameter counts that say what they count, and causal attention's FLOPs. Nothing is
asserted on a real timing; each test fails on the lesson as the first H200 run found it (2026-11-27) or as the
2026-11-28 run printed it."""

import dataclasses
import types

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import datasheets, flops
from gpulab.conditions import Conditions

from .conftest import ROOT
from .lesson_cells import Cells

LESSON = Cells("09_mfu_and_attention.ipynb")
code, run, define = LESSON.code, LESSON.run, LESSON.define
DATA = ROOT / "tests" / "data" / "lesson09"
H100 = "NVIDIA H100 80GB HBM3"
# Measured-looking ceilings (below the H100 SXM's dense peaks, as a card's steady best is), far apart per precision.
CEILINGS = {"fp32": 51.0, "tf32": 370.0, "fp16": 700.0, "bf16": 720.0}


def h100_ceilings(precisions=CEILINGS) -> dict:
    return {p: flops.Ceiling(p, CEILINGS[p], datasheet_tflops=datasheets.peak(H100, p)) for p in precisions}


@pytest.fixture
def lesson(monkeypatch, results_dir):
    """The notebook's globals after its imports and its model cells, in quick mode on this CPU; figures not shown."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "gpulab": gpulab}
    run(scope, 'plans.lesson("09")', "import gc", "def manual_attention", "class GPT(nn.Module)")
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
    monkeypatch.setattr(flops, "device_info", lambda device: types.SimpleNamespace(tf32=True, name=H100))
    return lesson


# ----- section 1: the parameters, counted and labelled ---------------------------------------------------------------

def test_the_parameter_counts_say_which_holds_the_position_embedding(lesson, capsys):
    """The H200 printed "57.69 M parameters" (cell 6) and "parameters (M) 56.90" (cell 13) unlabelled: the first holds
    the position embedding, the second (the N of 6·N) does not. Both now say so."""
    run(lesson, "class GPT(nn.Module)")
    said = capsys.readouterr().out
    model, n_params, N = lesson["model"], lesson["n_params"], lesson["N"]
    assert n_params - N == model.wpe.weight.numel() > 0
    assert (f"{n_params / 1e6:.2f} M parameters in all; N = {N / 1e6:.2f} M without the position embedding "
            f"({model.wpe.weight.numel() / 1e6:.2f} M)") in said
    with torch.device("meta"):  # the full-size model: the H200's two numbers
        full = lesson["GPT"](lesson["GPTConfig"](seq_len=1024, n_layer=8, n_head=12, n_embd=768))
    everything = sum(p.numel() for p in full.parameters())
    assert (round((everything - full.wpe.weight.numel()) / 1e6, 2), round(everything / 1e6, 2)) == (56.90, 57.69)
    assert '"N, without the position embedding (M)"' in code("def counted_per_token")

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
    assert ("That MFU is a share of the dense fp32 peak, 67 TFLOP/s. This card's dense bf16 peak is 989.5, 15× more: the "
            f"same step is {flops.percent(first.achieved_tflops / 989.5)} of it.") in said
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
