"""gpulab.flops: FLOPs counted by FlopCounterMode agree with the analytic rule, the ceiling search picks the fastest shape
(tested with injected timings, never a threshold on real ones), and MFU divides by the ceiling of the step's own
precision."""

import math
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpulab import flops, text
from gpulab.conditions import Conditions
from gpulab.device import DeviceInfo
from gpulab.models import TutorialCNN

# (n_layer, n_head, n_embd, seq_len, vocab_size, batch): the lesson's quick GPT, a wider one with a padded vocabulary,
# GPT-2 small at full length (on the meta device: shapes only, no arithmetic)
CONFIGS = [(2, 4, 64, 64, 257, 4), (3, 6, 96, 128, 320, 2), (12, 12, 768, 1024, 50304, 1)]


def gpt(n_layer, n_head, n_embd, seq_len, vocab_size, device="cpu", **options):
    cfg = text.GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd, **options)
    with torch.device(device):
        return text.GPT(cfg)


@pytest.mark.parametrize("config", CONFIGS, ids=["quick", "padded-vocabulary", "gpt2-small"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_the_count_of_every_matmul_agrees_with_flop_counter_mode(config, attention):
    *shape, batch = config
    device = "meta" if shape[2] >= 768 else "cpu"
    model = gpt(*shape, device=device, attention=attention)
    idx = torch.randint(0, shape[4], (batch, shape[3]), device=device)
    with sdpa_kernel(SDPBackend.MATH):  # the model's FLOPs: attention's backward without flash's recomputation
        counted = flops.training_flops(model, idx, idx)
    on_paper = flops.gpt_flops_per_token(shape[0], shape[2], shape[3], shape[4]) * batch * shape[3]
    assert counted.total == on_paper


@pytest.mark.parametrize("config", CONFIGS, ids=["quick", "padded-vocabulary", "gpt2-small"])
def test_the_rule_of_thumb_is_within_5_percent(config):
    n_layer, n_head, n_embd, seq_len, vocab_size, _ = config
    model = gpt(n_layer, n_head, n_embd, seq_len, vocab_size, device="meta")
    rule = flops.rule_flops_per_token(text.parameters(model, position=False), n_layer, n_embd, seq_len)
    exact = flops.gpt_flops_per_token(n_layer, n_embd, seq_len, vocab_size)
    assert abs(rule / exact - 1) < 0.05
    assert flops.gpt_flops_per_token(n_layer, n_embd, seq_len, vocab_size, training=False) * 3 == exact


def test_the_lessons_full_size_gpt_is_50_to_124_million_parameters_and_the_rule_holds():
    model = gpt(8, 12, 768, 1024, text.VOCAB, device="meta")
    n = text.parameters(model)
    assert 50e6 <= n <= 124e6
    rule = flops.rule_flops_per_token(text.parameters(model, position=False), 8, 768, 1024)
    assert abs(rule / flops.gpt_flops_per_token(8, 768, 1024, text.VOCAB) - 1) < 0.05


def test_the_cpus_flash_attention_is_counted_with_its_recomputation():
    """FlopCounterMode alone counts the CPU's flash kernel as zero; gpulab adds the GPU kernels' formulas for it: the
    backward pass recomputes the scores, one matmul of 2·B·T²·d per layer more than the model's FLOPs."""
    n_layer, n_head, n_embd, seq_len, vocab_size, batch = CONFIGS[0]
    model = gpt(n_layer, n_head, n_embd, seq_len, vocab_size, attention="sdpa")
    idx = torch.randint(0, vocab_size, (batch, seq_len))
    as_run = flops.training_flops(model, idx, idx).total
    with sdpa_kernel(SDPBackend.MATH):
        model_flops = flops.training_flops(model, idx, idx).total
    assert as_run - model_flops == n_layer * 2 * batch * seq_len**2 * n_embd
    assert "_scaled_dot_product_flash_attention_for_cpu" in " ".join(flops.count(
        lambda: model(idx, idx).backward()).by_operator())


def test_checkpointing_adds_the_blocks_forward_to_the_hardware_flops():
    n_layer, n_head, n_embd, seq_len, vocab_size, batch = CONFIGS[0]
    plain = gpt(n_layer, n_head, n_embd, seq_len, vocab_size)
    recomputed = gpt(n_layer, n_head, n_embd, seq_len, vocab_size, checkpoint=True)
    idx = torch.randint(0, vocab_size, (batch, seq_len))
    model_flops = flops.training_flops(plain, idx, idx).total
    hardware = flops.training_flops(recomputed, idx, idx).total
    blocks_forward = n_layer * (2 * 12 * n_embd**2 + 4 * seq_len * n_embd) * batch * seq_len
    last_matmul = n_layer * 2 * 4 * n_embd**2 * batch * seq_len  # fc2: its output is not needed by the backward pass,
    assert hardware - model_flops == blocks_forward - last_matmul  # so non-reentrant checkpointing stops before it


def test_training_flops_counts_a_cnn_with_a_loss_and_leaves_the_gradients_alone():
    model = TutorialCNN()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    F.cross_entropy(model(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    counted = flops.training_flops(model, x, y, loss_fn=F.cross_entropy)
    assert counted.total > 0 and set(counted.by_operator()) >= {"convolution", "convolution_backward"}
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    with_optimizer_step = flops.count(lambda: (F.cross_entropy(model(x), y).backward(),
                                               torch.optim.SGD(model.parameters(), lr=0.1).step()))
    assert with_optimizer_step.total == counted.total  # an optimizer's step does no matmul


def test_the_flop_table_starts_with_the_total_and_splits_it_by_module():
    model = gpt(*CONFIGS[0][:5])
    idx = torch.randint(0, 257, (2, 64))
    counted = flops.training_flops(model, idx, idx)
    table = counted.table(depth=2)
    assert table.iloc[0].module == "total" and table.iloc[0].flops == counted.total
    assert math.isclose(table.iloc[1:]["share"].sum(), 1.0)  # blocks and head: every matmul once
    assert counted.per(2 * 64) == counted.total / 128


# ----- which precision, and its ceiling ------------------------------------------------------------------------------

def fake_gpu(monkeypatch, capability):
    info = DeviceInfo(device="cuda:0", name="NVIDIA H100 80GB HBM3", torch_version=torch.__version__,
                      compute_capability=capability, tf32=capability >= (8, 0), bf16_native=capability >= (8, 0),
                      tensor_cores=True)
    monkeypatch.setattr(flops, "device_info", lambda device=None: info)
    monkeypatch.setattr(flops, "get_device", lambda device=None: torch.device("cpu"))
    return info


def test_autocast_decides_the_precision_whatever_the_tf32_switch_says(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    assert flops.precision_of(torch.bfloat16, tf32=True) == "bf16"
    assert flops.precision_of(torch.float16, tf32=True) == "fp16"
    assert flops.precision_of(None, tf32=True) == "tf32"
    assert flops.precision_of(torch.float32, tf32=False) == "fp32"
    with pytest.raises(ValueError, match="bf16 or fp16"):
        flops.precision_of(torch.float64)


def test_the_tf32_switch_is_read_as_the_course_sets_it(monkeypatch):
    fake_gpu(monkeypatch, (8, 0))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert flops.precision_of() == "tf32" and torch.backends.cuda.matmul.allow_tf32  # the legacy reader agrees
        torch.set_float32_matmul_precision("highest")
        assert flops.precision_of() == "fp32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_no_tf32_before_ampere_and_on_a_cpu(monkeypatch):
    assert flops.precision_of(None, tf32=True, device="cpu") == "fp32"
    assert flops.precisions_here("cpu") == ["fp32", "bf16"]
    fake_gpu(monkeypatch, (7, 5))  # a T4
    assert flops.precision_of(None, tf32=True) == "fp32"
    assert flops.precisions_here() == ["fp32", "fp16"]
    fake_gpu(monkeypatch, (9, 0))
    assert flops.precisions_here() == ["fp32", "tf32", "fp16", "bf16", "fp8"]


def forget_ceilings():
    flops._MEASURED.clear()
    flops._AGAIN.clear()


def test_datasheet_figures_are_dense_and_only_for_known_gpus():
    assert flops.datasheet("NVIDIA H100 80GB HBM3", "bf16") == 989.5  # dense; "with sparsity" would be 1979
    assert flops.datasheet("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(1978.9)
    assert flops.datasheet("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on an A100
    assert flops.datasheet("AMD EPYC 7B13", "fp32") is None


def test_the_ceiling_is_the_fastest_shapes_median_and_slow_shapes_are_skipped(monkeypatch):
    """The search's decisions, with injected timings: 50 TFLOP/s at the small square, 80 at the flat shape; the large
    square would take 0.5 s a product and is not tried."""
    rates = {64: 50e12, 96: 80e12}
    tried = []

    def timed(product, count, device):
        m, k = product.args[0].shape
        n = product.args[1].shape[1]
        tried.append((m, n, k))
        return [2 * m * n * k / rates.get(m, 1e12)] * count

    monkeypatch.setattr(flops, "timed_calls", timed)
    monkeypatch.setattr(flops, "MAX_PRODUCT_S", 1e-6)  # at these rates, the 8192³ product is "too slow"
    forget_ceilings()
    shapes = [(64, 64, 64), (96, 32, 64), (8192, 8192, 8192)]
    peak = flops.ceiling("fp32", "cpu", shapes=shapes, seconds=0.01)
    assert peak.shape == (96, 32, 64) and peak.tflops == pytest.approx(80.0)
    assert set(peak.by_shape) == {(64, 64, 64), (96, 32, 64)} and (8192, 8192, 8192) not in tried
    assert "fp32 ceiling 80" in str(peak) and peak.row()["m"] == 96
    forget_ceilings()


def test_on_a_cpu_the_ceiling_is_the_faster_of_mm_and_linear(monkeypatch):
    """A CPU without bf16 instructions runs F.linear (oneDNN) several times faster than torch.mm in bf16: the ceiling
    must be the best the device reaches, or a model's own layers would read above 100 % of it."""
    def timed(product, count, device):
        rate = 3e12 if product.func is torch.nn.functional.linear else 1e12
        return [2 * 64**3 / rate] * count

    monkeypatch.setattr(flops, "timed_calls", timed)
    forget_ceilings()
    assert flops.ceiling("bf16", "cpu", shapes=[(64, 64, 64)], seconds=0.01).tflops == pytest.approx(3.0)
    forget_ceilings()


H200 = Path(__file__).parent / "data" / "lesson09" / "2026-11-28-h200"


def h200_state(clock_low, clock_high, power, throttle=()):
    return Conditions(gpu=True, sm_clock_mhz=clock_low, sm_clock_low_mhz=clock_low, sm_clock_high_mhz=clock_high,
                      sm_clock_max_mhz=1980.0, gpu_power_w=power, gpu_power_limit_w=700.0, throttle=throttle)


@pytest.fixture
def power_limited_card(monkeypatch):
    """A card the search holds at its power limit (the H200's bf16 row of 2026-11-28: 694.9 TFLOP/s at 1515 MHz of
    1980, 556.8 W of 700, SW power cap) and that runs at its top clock again after a rest: ``card["burst"]`` TFLOP/s
    there. Timings and NVML readings injected; ``card["rests"]`` records each rest before a burst."""
    row = pd.read_csv(H200 / "09_ceilings.csv").set_index("precision").loc["bf16"]
    card = {"burst": 790.0, "rested": False, "rests": [], "sustained": float(row.ceiling_tflops),
            "held": h200_state(row.sm_clock_low_mhz, row.sm_clock_high_mhz, row.gpu_power_w, (row.throttle,))}

    def timed(product, count, device):
        m, k = product.args[0].shape
        rate = card["burst"] if card["rested"] else card["sustained"]
        return [2 * m * k * product.args[1].shape[1] / (rate * 1e12)] * count

    class Watch:
        def __init__(self, device=None, interval=0.05):
            self.conditions = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.conditions = h200_state(1980.0, 1980.0, 690.0) if card["rested"] else card["held"]

    def sleep(seconds):
        card["rested"] = True
        card["rests"].append(seconds)

    monkeypatch.setattr(flops, "timed_calls", timed)
    monkeypatch.setattr(flops, "Watch", Watch)
    monkeypatch.setattr(flops.time, "sleep", sleep)
    forget_ceilings()
    yield card
    forget_ceilings()


def test_the_ceiling_is_the_burst_at_the_top_clock_with_the_sustained_rate_beside_it(power_limited_card):
    """The search measures the sustained rate (the clocks settled under load: held down by the power limit); the
    fastest shape is then timed again after a rest, at the top clock. Both are kept with the clock and power they ran
    at; "of achievable" divides by the burst (a training step under the power limit runs at the top clock)."""
    c = flops.ceiling("bf16", "cpu", shapes=[(64, 64, 64), (96, 96, 96)], seconds=0.01)
    assert power_limited_card["rests"] == [flops.REST_S["quick"]]
    assert c.tflops == pytest.approx(790.0) and c.sustained.tflops == pytest.approx(694.866, abs=1e-3)
    assert c.conditions.sm_clock_low_mhz == 1980 and c.sustained.conditions.sm_clock_low_mhz == 1515
    row = c.row()
    assert row["ceiling_tflops"] == row["burst_tflops"] == pytest.approx(790.0)
    assert (row["sustained_sm_clock_low_mhz"], row["sustained_gpu_power_w"], row["sustained_throttle"]) == (
        1515.0, 556.8, "SW power cap")
    assert row["burst_sm_clock_low_mhz"] == 1980 and row["sm_clock_low_mhz"] == 1980
    assert "sustained 694.9 TFLOP/s at SM clock 1515 MHz of 1980, 557 W of 700, SW power cap" in str(c)
    assert flops.mfu(7.5e14, 1.0, c, precision="bf16").of_achievable == pytest.approx(750 / 790)


def test_a_burst_below_the_sustained_rate_leaves_the_ceiling_at_the_sustained_one(power_limited_card):
    """Clocks not yet back after the rest (or noise): the ceiling is never below what the search measured."""
    power_limited_card["burst"] = 650.0
    c = flops.ceiling("bf16", "cpu", shapes=[(64, 64, 64)], seconds=0.01)
    assert c.tflops == c.sustained.tflops and c.burst.tflops == pytest.approx(650.0)
    assert c.conditions is c.sustained.conditions and c.row()["burst_tflops"] == pytest.approx(650.0)


def beside(burst: float, sustained: float, held) -> str:
    """``Ceiling.burst_beside_sustained`` of a bf16 ceiling whose sustained rate ran in the state ``held``."""
    burst, sustained = flops.Timed(burst, h200_state(1980.0, 1980.0, 640.0)), flops.Timed(sustained, held)
    return flops.Ceiling("bf16", max(burst.tflops, sustained.tflops), burst=burst,
                         sustained=sustained).burst_beside_sustained()


def test_the_burst_beside_the_sustained_rate_blames_the_power_limit_only_where_it_held_the_clocks_down():
    """A gap is put down to the power limit only where NVML says it held the sustained clocks down; on a card it did
    not hold, a burst no faster than the sustained rate is not said to have lacked its clocks (it ran at the same)."""
    capped = h200_state(1515.0, 1515.0, 556.8, ("SW power cap",))
    assert "12% below its burst" in beside(790.0, 694.9, capped) and "Held at its power limit" in beside(
        790.0, 694.9, capped)
    assert "its clocks had not come back up" in beside(650.0, 694.9, capped)
    free = h200_state(1965.0, 1980.0, 420.0)
    for burst in (650.0, 700.0):
        said = beside(burst, 694.9, free)
        assert "no power limit held the clocks down" in said and "clocks had not come back" not in said, said
    assert "no clock reading here" in beside(700.0, 694.9, Conditions())
    assert flops.Ceiling("bf16", 700.0).burst_beside_sustained() == ""


def test_a_gpu_held_at_its_power_limit_reads_its_top_clock_within_the_rest_before_the_burst():
    """The rest before the burst (``REST_S``) from the H200's own record (NVML once a second, 2026-11-28): every time
    it went idle after the power limit had held its clock down, its next reading was the top clock."""
    watched = pd.read_csv(H200 / "monitor.csv")
    held = (watched.sm_clock_mhz < 0.95 * 1980) & watched.throttle.fillna("").str.contains("power cap")
    idle_after_held = watched.index[(watched.gpu_util_pct < 5) & held.shift(fill_value=False)]
    assert len(idle_after_held) >= 1
    assert (watched.loc[idle_after_held, "sm_clock_mhz"] == 1980).all() and flops.REST_S["full"] >= 1.0


def test_a_real_ceiling_on_the_cpu_is_measured_once_per_process():
    forget_ceilings()
    first = flops.ceiling("fp32", "cpu", shapes=[(32, 32, 32), (64, 64, 64)], seconds=0.002)
    assert first.precision == "fp32" and first.sustained.tflops == max(first.by_shape.values()) > 0
    assert first.tflops == max(first.burst.tflops, first.sustained.tflops)
    assert flops.ceiling("fp32", "cpu", shapes=[(32, 32, 32), (64, 64, 64)], seconds=0.002) is first
    with pytest.raises(ValueError, match="no tf32 ceiling"):
        flops.ceiling("tf32", "cpu")
    with pytest.raises(ValueError, match="unknown precision"):
        flops.ceiling("int8", "cpu")


def test_measuring_fp32_or_tf32_sets_the_switch_only_while_it_measures():
    before = torch.get_float32_matmul_precision()
    with flops._matmul_precision("tf32", gpu=True):
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    with flops._matmul_precision("fp32", gpu=True):
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == before


# ----- MFU and HFU -----------------------------------------------------------------------------------------------------

CEILINGS = {"fp32": flops.Ceiling("fp32", 50.0, datasheet_tflops=67.0), "tf32": flops.Ceiling("tf32", 400.0),
            "bf16": flops.Ceiling("bf16", 800.0, datasheet_tflops=989.5)}


def test_mfu_divides_by_the_dense_datasheet_peak_and_of_achievable_by_the_measured_ceiling():
    u = flops.mfu(4e14, 1.0, CEILINGS, precision="bf16")  # 400 TFLOP/s of model FLOPs
    assert u.mfu == pytest.approx(400 / 989.5)  # the field's MFU: comparable with published ones
    assert u.ceiling_tflops == 800.0 and u.of_achievable == pytest.approx(0.5)
    assert "MFU 40.4 % (400 TFLOP/s of model FLOPs over the dense bf16 peak of 989.5)" in str(u)
    assert "50 % of achievable (the bf16 ceiling measured here, 800)" in str(u)
    assert flops.percent(0.0189 / 67) == "0.0282 %"  # a small model's MFU is not "0.0 %"
    assert flops.percent(math.nan) == "n/a"

    row = u.row()
    assert row["mfu"] == pytest.approx(400 / 989.5) and row["of_achievable"] == pytest.approx(0.5)


def test_model_flops_above_the_peak_are_impossible_even_where_the_kernels_ran_fewer():
    """A causal fused attention kernel runs about half the square's FLOPs: HFU below MFU, and MFU may not exceed 1."""
    u = flops.mfu(1.1 * 989.5e12, 1.0, CEILINGS["bf16"], hardware_flops=0.6 * 989.5e12)
    assert u.hfu < 1 < u.mfu and u.impossible and "above the card's dense bf16 peak" in u.warning


def test_a_bf16_step_is_divided_by_the_bf16_ceiling_not_tf32s():
    assert flops.mfu(4e14, 1.0, CEILINGS, precision="bf16").of_achievable == pytest.approx(0.5)
    assert flops.mfu(4e14, 1.0, CEILINGS, precision="tf32").of_achievable == pytest.approx(1.0)  # torchtitan #668


def test_without_a_datasheet_figure_the_mfu_is_unknown_and_said_so():
    u = flops.mfu(2e14, 1.0, CEILINGS, precision="tf32")
    assert math.isnan(u.mfu) and math.isnan(u.row()["mfu"]) and u.of_achievable == pytest.approx(0.5)
    assert str(u).startswith("MFU unknown (no vendor's tf32 peak for this device")


def test_the_h200s_first_run_of_lesson_09_as_the_field_reads_it():
    """The H200 printed "MFU 65.2 %" for its first GPT run: 33.9 TFLOP/s in fp32 over a measured fp32 ceiling of 51.9
    (taken at a power-capped clock). Over the card's dense fp32 peak (67 TFLOP/s, the H100 SXM's: the H200 has the
    same GH100 chip) it is 50.5 %, and the ceiling's share is shown as 'of achievable'."""
    first = pd.read_csv(Path(__file__).parent / "data" / "h200" / "09_first_run.csv").iloc[0]
    ceiling = flops.Ceiling("fp32", first.ceiling_tflops, device_name=first.device_name,
                            datasheet_tflops=flops.datasheet(first.device_name, "fp32"))
    u = flops.mfu(first.flops_per_token * first.tokens_per_s, 1.0, ceiling, precision="fp32")
    assert ceiling.datasheet_tflops == 67.0
    assert u.mfu == pytest.approx(33.855 / 67, rel=1e-3) and u.of_achievable == pytest.approx(first.mfu, rel=1e-3)


def test_hfu_counts_recomputed_flops_and_impossible_numbers_are_never_shown():
    u = flops.mfu(3e14, 1.0, CEILINGS["bf16"], hardware_flops=4e14)
    assert u.of_achievable == pytest.approx(3 / 8) and u.hfu == pytest.approx(400 / 989.5)
    assert "HFU 40.4 %" in str(u) and not u.warning and u.row()["hfu"] == pytest.approx(400 / 989.5)
    assert math.isnan(flops.mfu(3e14, 1.0, CEILINGS["bf16"]).row()["hfu"])
    too_much = flops.mfu(1.04 * 989.5e12, 1.0, CEILINGS["bf16"])  # nanoGPT PR #464: 104 %, another card's peak
    assert too_much.impossible and "above the card's dense bf16 peak" in too_much.warning
    assert str(too_much).startswith("MFU not shown") and "%" not in str(too_much).split(":")[0]
    assert math.isnan(too_much.row()["mfu"]) and math.isnan(too_much.row()["of_achievable"])


def test_a_step_faster_than_its_ceiling_has_the_ceiling_measured_again(monkeypatch):
    """Lesson 03 on a busy CPU measured an fp32 ceiling of 0.0021 TFLOP/s and printed MFU 265 %: a step that beats
    the ceiling shows the ceiling was not the machine's best. It is measured again, once, and the better one kept."""
    machine = {"flop_per_s": 2.1e9, "searches": 0}  # first measured while busy

    def timed(product, count, device):
        m, k = product.args[0].shape
        if count == 1 and product.func is torch.mm:
            machine["searches"] += 1
        return [2 * m * k * product.args[1].shape[1] / machine["flop_per_s"]] * count

    monkeypatch.setattr(flops, "timed_calls", timed)
    forget_ceilings()
    busy = flops.ceiling("fp32", "cpu", shapes=[(64, 64, 64)], seconds=0.01)
    machine["flop_per_s"] = 40e9  # quiet now
    assert busy.tflops == pytest.approx(0.0021)
    u = flops.mfu(5.6e9, 1.0, busy, precision="fp32")  # 0.0056 TFLOP/s: 265 % of the busy ceiling
    assert u.ceiling_tflops == pytest.approx(0.04) and u.of_achievable == pytest.approx(0.14)
    assert flops.ceiling("fp32", "cpu", shapes=[(64, 64, 64)], seconds=0.01).tflops == pytest.approx(0.04)
    still = flops.mfu(9e10, 1.0, busy, precision="fp32")  # beats even the second: measured no third time
    assert machine["searches"] == 2 and still.impossible and "was not this machine's best" in still.warning
    assert "not shown" in str(still)
    forget_ceilings()


def test_a_waterfall_across_precisions_measures_every_step_against_one_peak(monkeypatch):
    """An fp32 step at 30 TFLOP/s and a bf16 step at 3× its speed: each over its own peak, bf16 reads lower
    (90/989.5 = 9 % < 30/67 = 45 %); over one reference peak, the fastest precision's, the curve rises."""
    monkeypatch.setattr(flops, "device_info", lambda device: types.SimpleNamespace(name="NVIDIA H200"))
    monkeypatch.setattr(flops, "get_device", lambda device: device)
    precision, peak = flops.reference_peak(["fp32", "bf16"], torch.device("cuda"))
    assert (precision, peak) == ("bf16", 989.5)
    assert flops.reference_peak(["fp16", "bf16", "fp32"], torch.device("cuda"))[0] == "bf16"  # on a tie
    fp32 = flops.mfu(30e12, 1.0, flops.Ceiling("fp32", 50.0, datasheet_tflops=67.0))
    bf16 = flops.mfu(90e12, 1.0, flops.Ceiling("bf16", 700.0, datasheet_tflops=989.5))
    assert bf16.mfu < fp32.mfu and bf16.against(peak) == pytest.approx(3 * fp32.against(peak))


def test_a_ceiling_must_be_a_positive_rate_of_a_known_precision():
    with pytest.raises(ValueError):
        flops.Ceiling("bf16", 0.0)
    with pytest.raises(ValueError):
        flops.Ceiling("int4", 10.0)


@pytest.mark.gpu
def test_gpu_ceilings_are_measured_for_every_native_precision():
    """Each at a clock recorded with it, below the card's dense peak."""
    forget_ceilings()
    found = flops.ceilings(device="cuda")
    assert set(found) == set(flops.precisions_here("cuda"))
    for p, c in found.items():
        assert c.tflops > 0 and c.shape in c.by_shape and c.conditions.sm_clock_low_mhz > 0
        if c.datasheet_tflops:  # a measured ceiling above the dense datasheet figure would mean a wrong count or clock
            assert c.tflops < 1.05 * c.datasheet_tflops, p


def test_a_ceiling_above_its_datasheet_peak_is_never_shown_as_a_share_of_it():
    fine = flops.Ceiling("bf16", 700.0, datasheet_tflops=989.5)
    assert fine.row()["of_datasheet"] == pytest.approx(700 / 989.5) and "71% of the datasheet's dense 989.5" in str(fine)
    wrong_row = flops.Ceiling("bf16", 1200.0, datasheet_tflops=989.5)
    assert wrong_row.row()["of_datasheet"] is None
    assert "above the datasheet's dense 989.5: impossible" in str(wrong_row) and "%" not in str(wrong_row)
