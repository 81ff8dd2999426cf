"""The page on how the course measures (notebooks/how_the_course_measures.ipynb): a page beside the lessons, not a
lesson; its sections keep the anchors the lessons link to; it stays within a lesson's size; and it runs whole on the
CPU and on the CPU playing a Tesla T4 and an NVIDIA H200 (tests/cuda_stand_in.py), where its GPU branches (events and
the untimed hold, the spinning thread, triton's do_bench, the card's datasheet peaks) run. Its code cells run here in
one scope, as a kernel runs them, at this test's small sizes (nbval runs it at its own quick sizes in `make test`);
nothing is asserted on a timing."""

import ast
import contextlib
import io
import re
import time

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import datasheets, flops, results
from gpulab.colab import SETUP_CELL
from gpulab.commands import cli, record, verify
from gpulab.commands.notebook_upkeep import PAGES, course, is_lesson, lessons, pages

from .conftest import ROOT

PAGE = ROOT / "notebooks" / "how_the_course_measures.ipynb"
ANCHORS = ("timing", "comparisons", "ceilings", "busy", "mfu", "reference-results", "other-timers")  # lessons link here
SMALL = {"large": 96, "small": 16, "runs": 5, "min_time": 0.01, "width": 32, "batch": 64, "toy": 8}  # this test's sizes


def cells(kind: str) -> list[str]:
    return [c.source for c in nbformat.read(PAGE, as_version=4).cells if c.cell_type == kind]


# ---- a page, not a lesson -----------------------------------------------------------------------------------------

def test_the_page_is_a_page_and_every_other_notebook_a_numbered_lesson():
    assert PAGE.name in PAGES and pages(ROOT) == [PAGE] and not is_lesson(PAGE)
    strays = [p.name for p in (ROOT / "notebooks").glob("*.ipynb") if not is_lesson(p) and p.name not in PAGES]
    assert not strays, f"a notebook that is neither a lesson (NN_name.ipynb) nor a page named in PAGES: {strays}"
    assert PAGE not in lessons(ROOT) and lessons(ROOT) and all(re.match(r"\d\d_", p.name) for p in lessons(ROOT))
    assert not [folder for folder in ("solutions", "exercises") if (ROOT / folder / PAGE.name).exists()]


def test_make_course_runs_the_lessons_then_the_page(monkeypatch, tmp_path):
    assert course(ROOT) == lessons(ROOT) + [PAGE]
    ran = []
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("gpulab.commands.course.run_course",
                        lambda notebooks, *args: ran.extend(notebooks) or pd.DataFrame({"status": ["passed"]}))
    assert cli.main(["course", "--out", str(tmp_path)]) == 0
    assert [p.name for p in ran] == [p.name for p in course(ROOT)]


def test_reference_record_runs_the_lessons_only(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(record, "record", lambda *a, **k: pytest.fail("a dry run ran the lessons"))
    assert cli.main(["reference", "record", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert PAGE.name not in out and all(p.name in out for p in lessons(ROOT))


def test_the_verification_runs_the_page_in_its_smoke_run_and_gives_it_no_full_mode_part():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    parts = verify.verify_parts(notebooks, tests=ROOT / "tests")
    smoke = next(p for p in parts if p.name == "smoke")
    assert PAGE in smoke.lessons
    assert [p.notebook for p in parts if p.notebook] == lessons(ROOT)


# ---- its shape ----------------------------------------------------------------------------------------------------

def test_each_section_starts_with_the_anchor_the_lessons_link_to_in_order_and_the_title_lists_them():
    markdown = cells("markdown")
    starts = [re.match(r'<a id="([\w-]+)"></a>\n## ', source) for source in markdown]
    assert tuple(m.group(1) for m in starts if m) == ANCHORS
    text = "\n".join(markdown)
    assert all(text.count(f'<a id="{anchor}">') == 1 for anchor in ANCHORS)
    assert markdown[0].startswith("# How the course measures") and "**You will learn**" in markdown[0]
    assert all(f"](#{anchor})" in markdown[0] for anchor in ANCHORS)


def test_it_starts_with_the_setup_cell_and_keeps_to_a_lessons_size():
    code = cells("code")
    assert code[0] == SETUP_CELL
    lines = [sum(1 for line in source.splitlines() if line.strip()) for source in code]
    words = sum(len(source.split()) for source in cells("markdown"))
    assert sum(lines) <= 600 and max(lines) <= 60 and words <= 3000, (sum(lines), max(lines), words)


def test_a_gpu_branch_only_adds_what_a_cpu_lacks():
    """Every `if on_gpu:` adds the GPU's own calls and has no else: the CPU's path is the same code, never a
    different one. do_bench is called only there."""
    trees = [ast.parse(source) for source in cells("code")[1:]]
    branches = [node for tree in trees for node in ast.walk(tree)
                if isinstance(node, ast.If) and ast.unparse(node.test) == "on_gpu"]
    assert len(branches) >= 3 and not [ast.unparse(b) for b in branches if b.orelse]

    def do_bench_calls(nodes) -> int:
        return sum(isinstance(n, ast.Call) and ast.unparse(n.func) == "do_bench" for node in nodes for n in ast.walk(node))
    assert do_bench_calls(trees) == do_bench_calls(statement for b in branches for statement in b.body) == 1


def test_every_lesson_links_to_the_page():
    unlinked = [p.name for p in lessons(ROOT) if PAGE.name not in "\n".join(
        c.source for c in nbformat.read(p, as_version=4).cells if c.cell_type == "markdown")]
    assert not unlinked, f"lessons without a link to {PAGE.name}: {unlinked}"


def test_the_readme_links_the_page():
    assert f"notebooks/{PAGE.name}" in (ROOT / "README.md").read_text()


def test_the_page_says_which_state_gets_which_advice_and_that_colab_gets_none(monkeypatch):
    """The page said only a busy CPU gets "rerun on a quiet machine", which Colab's 2 vCPUs never get (conditions)."""
    said = " ".join(next(s for s in cells("markdown") if '<a id="ceilings">' in s).split())
    busy = gpulab.conditions.Conditions(load_avg=5.0, cpu_cores=2)
    hot = gpulab.conditions.Conditions(load_avg=0.5, cpu_cores=4, gpu=True, throttle=("HW thermal slowdown",))
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert busy.advice().startswith("rerun on a quiet machine") and hot.advice().startswith("check the GPU's cooling")
    assert '"rerun on a quiet machine", except on Colab' in said and '"check the GPU\'s cooling"' in said
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261201-060000_RC00")
    assert busy.advice() == ""


def held_sentence(events_s: list, held_s: list) -> str:
    """What the timing section prints of the small products timed between events, without and behind the hold."""
    source = next(s for s in cells("code") if "held = gpulab.Comparison.of(" in s)
    source = source[source.index('if "CUDA events behind a hold" in ways:'):source.index("sync_ref =")]
    timed = {("small", "CUDA events"): events_s, ("small", "CUDA events behind a hold"): held_s}
    medians_us = pd.DataFrame({"small": {way: 1e6 * sorted(t)[len(t) // 2] for (_, way), t in timed.items()}})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(source, {"ways": [way for _, way in timed], "timed": timed, "medians_us": medians_us, "gpulab": gpulab,
                      "ratio_text": lambda c: f"{c.speedup:.2f}×"})
    return printed.getvalue()


def test_the_hold_is_said_to_remove_the_launch_only_where_it_did():
    """It was said whatever the verdict: within noise too, where the events behind the hold read as much."""
    assert "What the hold removes is the launch" in held_sentence([30e-6] * 7, [10e-6, 11e-6, 9e-6, 10e-6, 12e-6,
                                                                                  10e-6, 11e-6])
    same = held_sentence([10e-6, 11e-6, 9e-6, 10e-6, 12e-6, 10e-6, 11e-6], [11e-6, 10e-6, 10e-6, 9e-6, 11e-6, 12e-6,
                                                                            10e-6])
    assert "within noise" in same and "What the hold removes" not in same and "no difference" in same


def test_the_written_out_pairs_warm_both_up_before_the_first_clock():
    """Step 1 says "Warm both up", and the written-out interleaved() timed from the first call."""
    tree = ast.parse(next(s for s in cells("code") if "def interleaved(" in s))
    scope, happened = {}, []
    exec(compile(ast.Module([n for n in tree.body if getattr(n, "name", "") == "interleaved"], []), "<page>", "exec"),
         scope)
    scope.update(device="cpu", timing=type("timing", (), {"synced_clock": staticmethod(
        lambda device: happened.append("clock") or float(len(happened)))}))
    scope["interleaved"](lambda: happened.append("a"), lambda: happened.append("b"), pairs=2, calls=1)
    assert happened[:3] == ["a", "b", "clock"]
    assert happened.count("a") == happened.count("b") == 3


def test_the_timing_section_names_the_timer_option_lesson_01_sends_the_learner_there_for():
    """Lesson 01 times its copies with gpulab.bench(..., alone=True) and links #timing for why: the page names it."""
    lesson = " ".join(c.source for c in nbformat.read(ROOT / "notebooks" / "01_cuda_basics.ipynb", as_version=4).cells)
    assert "alone=True" in lesson and "how_the_course_measures.ipynb#timing" in lesson
    timing_section = next(s for s in cells("markdown") if '<a id="timing">' in s)
    assert "`gpulab.bench(fn, alone=True)`" in timing_section


# ---- run whole, on the CPU and as two cards -----------------------------------------------------------------------

def run_page() -> dict:
    """Every code cell of the page, in order, in one scope (a kernel's globals), at this test's sizes; the scope, with
    what it displayed and printed."""
    shown, printed = [], io.StringIO()
    scope = {"__name__": "__main__", "display": lambda *objects: shown.extend(objects), "displayed": shown}
    with contextlib.redirect_stdout(printed):
        for i, source in enumerate(cells("code")):
            exec(compile(source, f"<{PAGE.name}, code cell {i}>", "exec"), scope)
            if "SIZE = {" in source:
                scope["SIZE"].update(SMALL)
    scope["printed"] = printed.getvalue()
    return scope


def fake_do_bench(calls):
    """triton.testing.do_bench as a GPU answers it (ms per call), on the host clock; records each call's return_mode."""

    def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        calls.append(return_mode)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return do_bench


@pytest.fixture(scope="module", params=["cpu", "Tesla T4", "NVIDIA H200"])
def page(request, tmp_path_factory):
    """The page run whole in quick mode: on the CPU, or on the CPU playing a card (NVML reading it 100 % utilised,
    SM activity 1 %, where GPM is offered); its scope, with `card` (None on the CPU), `sleeps` (the spinning thread's
    torch.cuda._sleep calls) and `do_bench` (triton's calls)."""
    from .cuda_stand_in import installed

    card = None if request.param == "cpu" else request.param
    before = torch.get_float32_matmul_precision()
    sleeps, benches = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULAB_QUICK", "1")
        mp.setenv("GPULAB_RESULTS", str(tmp_path_factory.mktemp("results")))
        mp.setattr(plt, "show", lambda *args, **kwargs: plt.close("all"))
        mp.setattr(flops, "search_shapes", lambda device=None: [(32, 32, 32), (64, 64, 64)])
        flops._MEASURED.clear()  # ceilings are kept per device, and the CPU and its stand-ins are all "cpu"
        results.environment.cache_clear()  # as are the columns that say where a row was measured
        with installed(card) if card else contextlib.nullcontext() as gpu, pytest.MonkeyPatch.context() as inner:
            if gpu:
                gpu.nvml.gpu_util_pct, gpu.nvml.sm_activity_pct = 100, 1.0
                inner.setattr(torch.cuda, "_sleep", lambda cycles: sleeps.append(cycles))
                import triton.testing
                inner.setattr(triton.testing, "do_bench", fake_do_bench(benches))
            scope = run_page()
        flops._MEASURED.clear()
        results.environment.cache_clear()
    torch.set_float32_matmul_precision(before)
    plt.close("all")
    return {**scope, "card": card, "sleeps": sleeps, "do_bench": benches}


def test_the_timing_section_times_each_way_and_on_a_gpu_between_events_behind_the_hold(page):
    gpu = page["card"] is not None
    ways = ["host clock", "host clock, synchronised"] + (["CUDA events", "CUDA events behind a hold"] if gpu else [])
    assert list(page["ways"]) == ways and all(len(t) == SMALL["runs"] for t in page["timed"].values())
    said = page["printed"]
    assert ("Small products between events:" in said) == gpu
    assert ("CUDA events and the hold need a GPU's queue" in said) != gpu
    assert page["sleeps"].count(page["HOLD_CYCLES"]) == (2 * SMALL["runs"] + 2 * SMALL["runs"] if gpu else 0)
    assert page["l2"].pairs == SMALL["runs"] and "cold cache" in said


def test_the_comparisons_section_shows_the_written_out_method_and_gpulab_compare_on_the_same_code(page):
    rows = page["rows"]
    assert list(rows) == ["torch_sum vs python_sum, written out", "torch_sum vs python_sum, gpulab.compare",
                          "torch_sum_again vs torch_sum, written out", "torch_sum_again vs torch_sum, gpulab.compare"]
    assert page["median_interval"]([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, 1.0, 5.0, 1 - 2 / 32)  # 5 pairs: 94 %
    assert "The same code against itself: " in page["printed"]


def test_the_ceilings_are_the_cards_precisions_with_its_dense_datasheet_peaks(page):
    card = page["card"]
    narrow = "fp16" if card == "Tesla T4" else "bf16"
    assert page["PRECISIONS"] == ["fp32", narrow]
    sheet = datasheets.find(card) if card else None
    for p, ceiling in page["ceilings"].items():
        assert ceiling.datasheet_tflops == (sheet.tflops[p] if sheet else None)
        assert ceiling.burst is not None and ceiling.sustained is not None
    table = next(d for d in page["displayed"] if hasattr(d, "data") and "burst at" in d.data)
    assert list(table.data.index) == page["PRECISIONS"]
    assert all(("MHz" in said) == bool(card) for said in table.data["burst at"])  # NVML's clocks, on a GPU only


def test_the_busy_section_measures_a_spinning_thread_only_on_a_gpu_and_reads_nvml_there(page):
    card = page["card"]
    labels = [b.label for b in page["measured"]]
    assert labels == ["large products"] + (["one thread spinning"] if card else [])
    shares = page["shares"]
    assert shares.kernel_busy.isna().all()  # a CPU's trace has no kernels, on the stand-in too
    if card:
        assert (shares.nvml_util == 1.0).all() and page["sleeps"].count(page["SPIN_CYCLES"]) > 0
        assert shares.sm_activity.isna().all() if card == "Tesla T4" else (shares.sm_activity == 0.01).all()
    else:
        assert shares.nvml_util.isna().all() and "it was recorded on a CPU" in page["printed"]


def test_mfu_divides_by_the_dense_peak_of_each_steps_precision_and_compares_them_on_one_peak(page):
    card = page["card"]
    table = page["mfu_table"]
    assert list(table.index) == page["PRECISIONS"]
    if card:
        sheet = datasheets.find(card).tflops
        assert table["its dense peak"].tolist() == [sheet[p] for p in page["PRECISIONS"]]
        assert (page["reference"], page["reference_tflops"]) == (page["PRECISIONS"][1], sheet[page["PRECISIONS"][1]])
    else:  # a CPU: no vendor peak, no MFU; one peak is the fastest ceiling measured here
        assert table["its dense peak"].isna().all() and table["MFU"].isna().all()
        assert page["reference_tflops"] == max(c.tflops for c in page["ceilings"].values())
    assert page["step_flops"] == flops.training_flops(page["mlp"](SMALL["width"]), torch.randn(
        SMALL["batch"], SMALL["width"]), None, loss_fn=lambda out, _: out.float().square().mean()).total
    assert page["printed"].count("for 4× the FLOPs") == 2


def test_the_pages_own_row_carries_where_and_how_it_was_measured(page):
    row = page["row"]
    assert {"schema", "recorded_at", "device_name", "torch", "quick", "median_s", "load_avg", "caveat"} <= set(row)
    assert row["device_name"] == (page["card"] or gpulab.device_info("cpu").name) and row["quick"] is True


def test_do_bench_runs_on_a_gpu_only_and_the_cpu_says_why_not(page):
    gpu = page["card"] is not None
    assert ("triton do_bench" in page["agree"].index) == gpu
    assert page["do_bench"] == (["median"] * len(page["rounds"]["triton do_bench"]) if gpu else [])
    assert ("do_bench was not run: it needs a GPU" in page["printed"]) != gpu


def test_each_shipped_table_is_introduced_by_what_it_holds(page):
    """The page showed lesson 01's sync rows and lesson 09's ceilings with no word on what they were."""
    said = page["printed"]
    sync = gpulab.reference("01_sync")
    assert (f"Shipped with the course: twenty {sync['n'].iloc[0]}² products of lesson 01, read each way on "
            f"{sync['device_name'].iloc[0]} (ms):") in said
    assert "burst_tflops" not in gpulab.reference("09_ceilings")
    assert ("Shipped with the course: each precision's ceiling on a real card, at the clock and power it ran at; "
            "single sustained ceilings, recorded before the course measured a burst:") in said
