"""Lesson 11's cells on the paths a GPU takes, run here on the CPU with the GPU's answers injected: checkpointing's HFU
against the model's FLOPs, FP8's three training matmuls each scaled and laid out as torch._scaled_mm wants them, the
crossover against bf16, torchao's recipe where it is installed, and the whole GPT's fp8 step raced against bf16.
Nothing is asserted on a real timing."""

import dataclasses
import functools
import sys
import types

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import plans

from .lesson_cells import Cells

LESSON = Cells("11_memory_and_fp8.ipynb")
run = LESSON.run


@pytest.fixture
def lesson(monkeypatch, results_dir):
    """The notebook's globals after its imports (and its text), in quick mode on this CPU; figures not shown."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "gpulab": gpulab}
    run(scope, 'plans.lesson("11")', "import inspect")
    scope["displayed"] = []
    scope["display"] = scope["displayed"].append
    yield scope
    torch.set_float32_matmul_precision(before)
    torch._dynamo.reset()
    plt.close("all")


@pytest.fixture
def with_fp8(lesson):
    """The lesson sees a GPU of compute capability 9.0 (FP8), and its plan an H100's in quick mode, while its work runs
    on this CPU."""
    info = dataclasses.replace(lesson["info"], compute_capability=(9, 0), bf16_native=True)
    lesson.update(on_gpu=True, info=info, capability=(9, 0),
                  plan=plans.plan_for("11", plans.Card.named("NVIDIA H100 80GB HBM3"), quick=True))
    return lesson


@pytest.fixture
def torchao(monkeypatch):
    """torchao's float8 recipe as a stand-in: ``convert_to_float8_training`` records what it was given, and torch's
    compiler runs Dynamo's graphs as they are (no code generation on a 2-core CPU)."""
    converted = []

    def convert_to_float8_training(module, module_filter_fn=None, **options):
        converted.append((module, [name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)
                                   and (module_filter_fn is None or module_filter_fn(m, name))]))
        return module

    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", types.SimpleNamespace(
        convert_to_float8_training=convert_to_float8_training))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    return converted


# ----- section 2: HFU of checkpointing -----------------------------------------------------------------------------------

def test_checkpointing_hfu_counts_what_the_causal_kernels_run(lesson, results_dir, capsys):
    """FlopCounterMode's upper bound made the step without checkpointing run more than the model's FLOPs (1.02 on the
    H200); counted as the causal kernels run it, it runs fewer, and checkpointing adds its recomputation. Each line
    names the peak its MFU divides by."""
    run(lesson, "ckpt_vs = gpulab.compare")
    rows = pd.read_csv(results_dir / "11_checkpointing.csv").set_index("config")
    assert rows.loc["no checkpointing", "hardware_over_model"] < 1 < rows.loc["checkpointed blocks", "hardware_over_model"]
    assert capsys.readouterr().out.count("(the fp32 ceiling measured here") == 2


# ----- section 3: FP8's three training matmuls ---------------------------------------------------------------------------

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


def test_the_fp8_crossover_on_a_gpus_path_times_forward_and_both_gradients(with_fp8, scaled_mm_calls, capsys,
                                                                          results_dir, monkeypatch):
    with_fp8["FP8"] = {**with_fp8["FP8"], "n": [64, 128]}
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run(with_fp8, "class Float8Matmul", "fp8_rows = []")
    rows = pd.read_csv(results_dir / "11_fp8.csv")
    assert list(rows.n) == [64, 128] and (rows.recipe == "Float8Matmul (compiled scaling)").all()
    assert (rows.rel_error_grad_weight < 0.15).all()
    assert "fp8's three training matmuls (scaling included)" in capsys.readouterr().out


def test_the_fp8_crossover_uses_torchaos_recipe_where_torchao_is_installed(lesson, torchao):
    run(lesson, "class Float8Matmul")
    out, grad_x, grad_w = lesson["training_matmuls"](32, fp8=True)()
    assert len(torchao) == 1 and isinstance(torchao[0][0][0], torch.nn.Linear)
    assert out.shape == grad_x.shape == grad_w.shape == (32, 32)


def test_the_whole_gpts_fp8_step_converts_only_the_mlps_linears_and_is_raced_against_bf16(with_fp8, torchao, capsys):
    """The race of section 3's last cell on a GPU's path: both sides the same bf16 step from the same weights, the
    candidate's MLP linears given to torchao (here a stand-in that converts nothing), their losses compared."""
    with_fp8["FP8"] = {**with_fp8["FP8"], "micro": 2}
    run(with_fp8, "class Float8Matmul", "def run_steps")
    assert len(torchao) == 1
    converted = torchao[0][1]
    assert converted and all(".mlp." in f".{name}." for name in converted)
    assert {name.rsplit(".", 1)[-1] for name in converted} == {"fc", "fc2"}
    said = capsys.readouterr().out
    assert "Training with the MLP's linears in float8 (torchao): fp8 MLP linears vs bf16" in said
    assert "differ by 0 nats at most" in said  # the stand-in converts nothing: the same training, step by step
