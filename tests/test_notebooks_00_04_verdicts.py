"""Lessons 00–04 say no more than their spread supports: verdicts come from comparisons (interleaved pairs, a median
ratio with its interval), the helpers that turn comparisons into claims do what their cells say, and no chart writes
a bare ratio of two timings."""

import ast

import nbformat
import pytest
import torch

import gpulab
from gpulab import Comparison

from .conftest import ROOT
from .test_notebooks_00_04_gpu_path import function_source

LESSONS = sorted((ROOT / "notebooks").glob("0[0-4]_*.ipynb"))


def defined(lesson: str, name: str, **scope):
    """The function ``name`` of a lesson's cell, defined in ``scope``."""
    exec(compile(function_source(lesson, name), f"<lesson {lesson}: {name}>", "exec"), scope)
    return scope[name]


@pytest.mark.parametrize("lesson", ["00", "01"])
def test_a_crossover_needs_faster_beyond_the_noise_at_every_larger_size(lesson):
    crossover = defined(lesson, "crossover")
    assert crossover({16: "slower", 64: "faster", 256: "faster"}) == 64
    assert crossover({16: "faster", 64: "within noise", 256: "faster", 1024: "faster"}) == 256  # noise breaks a run
    assert crossover({16: "faster", 64: "faster", 256: "within noise"}) is None  # not faster at the largest size
    assert crossover({}) is None


def test_lesson_00_reads_shipped_medians_as_such():
    crossover_of_medians = defined("00", "crossover_of_medians", crossover=defined("00", "crossover"))
    ref = gpulab.reference_for("00_matmul")
    assert crossover_of_medians(ref) is not None  # the shipped H100 rows do cross
    assert crossover_of_medians(ref[ref["on"] == "cpu"]) is None
    code = "\n".join(c.source for c in nbformat.read(LESSONS[0], as_version=4).cells if c.cell_type == "code")
    assert "single shipped" in code  # what the printed reference crossover says it rests on


def test_lesson_03_compares_batch_sizes_per_sample():
    from gpulab.batching import per_sample  # lesson 03's comparison of steps, per sample

    steps = Comparison.of([0.010] * 5, [0.020] * 5, labels=("batch 8", "batch 32"), caveats=("a caveat",))
    c = per_sample(steps, 8, 32)  # a step of 32 takes twice as long as one of 8: twice the samples per second
    assert c.speedup == pytest.approx(2.0) and c.verdict == "faster" and c.caveats == ("a caveat",)
    assert (c.baseline, c.candidate, c.pairs) == ("batch 8", "batch 32", 5)


def test_lesson_04s_products_set_their_own_tf32_mode_call_by_call():
    """Two sides of a comparison take turns: each sets the switch it needs before its product."""
    from gpulab import precision

    tf32 = defined("04", "tf32", torch=torch)
    product_in = defined("04", "product_in", torch=torch, precision=precision, device=torch.device("cpu"), tf32=tf32)
    fp32, with_tf32 = product_in("fp32", 4), product_in("tf32", 4)
    try:
        with_tf32()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        assert fp32().dtype == torch.float32
        assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision("highest")


def _bars_calls(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "plots.bars":
            yield {k.arg: ast.unparse(k.value) for k in node.keywords}


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_bar_chart_writes_a_bare_ratio_of_two_timings(path):
    """plots.bars writes value / baseline next to every bar it has no Comparison for. Allowed only for counts that
    carry no noise (memory) and for shipped reference rows, whose title says they are single medians."""
    bare = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        for kwargs in _bars_calls(cell.source):
            if "baseline" not in kwargs or "comparisons" in kwargs:
                continue
            if "MiB" in kwargs.get("unit", "") or "shipped" in kwargs.get("title", ""):
                continue
            bare.append(kwargs)
    assert not bare, f"{path.name}: bars with a baseline and no comparisons: {bare}"
