import math
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gpulab import plots  # noqa: E402


def test_bars_annotate_speedups():
    ax = plots.bars({"fp32": 10.0, "bf16": 40.0}, baseline="fp32", unit="TFLOP/s")
    texts = [t.get_text() for t in ax.texts]
    assert any("4.00×" in t for t in texts) and any("1.00×" in t for t in texts)


def test_bars_lower_is_better():
    ax = plots.bars({"slow": 2.0, "fast": 1.0}, baseline="slow", unit="s", higher_is_better=False)
    assert any("2.00×" in t.get_text() for t in ax.texts)


def test_curves_one_line_per_group_and_marks():
    frame = pd.DataFrame({"n": [1, 2, 1, 2], "t": [1, 2, 3, 4], "device": ["cpu", "cpu", "cuda", "cuda"]})
    ax = plots.curves(frame, "n", "t", by="device")
    plots.mark(ax, 1.5, "crossover")
    plots.hline(ax, 3, "limit")
    assert len(ax.get_lines()) == 4 and ax.get_xscale() == "log"
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"cpu", "cuda"}


def test_style_keeps_interactive_mode_switched_on_inside_it():
    """Jupyter's inline backend turns interactive mode on at the first figure; later figures need it kept."""
    import matplotlib.pyplot as plt

    plt.ioff()
    with plots.style():
        plt.ion()
    assert plt.isinteractive()
    plt.ioff()


def test_reference_overlay_keeps_the_learners_title_labels_and_lines():
    from gpulab import reference_for

    mine = pd.DataFrame({"working_set_mb": [1.0, 4.0, 16.0], "gb_per_s": [10.0, 20.0, 25.0]})
    ax = plots.curves(mine, "working_set_mb", "gb_per_s", logy=False, xlabel="MB", ylabel="GB/s", title="Mine")
    ref = reference_for("01_copy_bandwidth")
    plots.overlay_reference(ax, ref, "working_set_mb", "gb_per_s")
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("Mine", "MB", "GB/s")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "gb_per_s" and any(label.endswith("(reference)") for label in labels[1:])
    assert len(ax.get_lines()) == 1 + ref["device_name"].nunique()


def test_reference_overlay_of_nothing_draws_nothing(capsys):
    from gpulab import reference_for

    ref = reference_for("no_such_experiment")
    assert ref.empty and "No reference results for 'no_such_experiment'" in capsys.readouterr().out
    ax = plots.curves(pd.DataFrame({"n": [1, 2], "t": [1, 2]}), "n", "t", title="T")
    plots.overlay_reference(ax, ref, "n", "t")
    assert len(ax.get_lines()) == 1 and ax.get_title() == "T"


# ---- log axes read like numbers ----------------------------------------------------------------------------------

PLAIN = re.compile(r"^\d+(\.\d+)?[kMGTPfpnµ]?$")  # 0.5, 2, 4096, 1k, 20µ: never 5.6×10⁻¹ or 1e+03
RANGES = {  # (x values, y values) of a curve
    "narrow (base 2)": ([16, 32, 64, 128, 256, 512], [0.52, 0.6, 0.7, 0.8, 0.85, 0.9]),
    "wide": ([1e3, 1e5, 1e7, 1e9], [1e-6, 1e-4, 1e-2, 1e-1]),
    "within one decade": ([3.1, 3.5, 4.2], [310, 330, 390]),
    "twelve doublings": ([2**8, 2**14, 2**20], [1e-5, 1e-3, 1e2]),
    "twenty decades": ([1e-9, 1e11], [1e-12, 1e12]),
}


def _shown_labels(axis):
    """The tick labels drawn on ``axis`` (inside its view, not empty), left to right or bottom to top."""
    lo, hi = sorted(axis.get_view_interval())
    return [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_text()]


def _assert_readable(ax):
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() != "log":
            continue
        labels = _shown_labels(axis)
        texts = [label.get_text() for label in labels]
        assert len(labels) >= 2, f"{axis.axis_name}: {texts}"
        assert all(PLAIN.match(text) for text in texts), texts
        boxes = [label.get_window_extent(renderer) for label in labels]
        assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), f"{axis.axis_name} labels overlap: {texts}"


def _figure(width):
    with plots.style():
        return plt.subplots(1, 3, figsize=(7, 3))[1][0] if width == "a third" else plt.figure().add_subplot()


@pytest.mark.parametrize("width", ["full", "a third"])
@pytest.mark.parametrize("case", RANGES)
def test_curves_log_axes_read_like_numbers_and_do_not_overlap(case, width):
    xs, ys = RANGES[case]
    ax = plots.curves(pd.DataFrame({"x": xs, "y": ys}), "x", "y", ax=_figure(width))
    _assert_readable(ax)
    plt.close(ax.figure)


@pytest.mark.parametrize("width", ["full", "a third"])
@pytest.mark.parametrize("case", RANGES)
def test_log_scale_on_a_learners_own_axis(case, width):
    xs, ys = RANGES[case]
    ax = _figure(width)
    ax.scatter(xs, ys)
    plots.log_scale(ax, "x")
    plots.log_scale(ax, "y")
    _assert_readable(ax)
    plt.close(ax.figure)


def test_matplotlibs_own_log_labels_are_what_this_replaces():
    """The check above can fail: matplotlib's default labels over a narrow range are 3×10⁰ and the like."""
    ax = _figure("full")
    ax.scatter(*RANGES["within one decade"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.figure.canvas.draw()
    texts = [t.label1.get_text() for axis in (ax.xaxis, ax.yaxis) for t in axis.get_minor_ticks() + axis.get_major_ticks()
             if min(axis.get_view_interval()) <= t.get_loc() <= max(axis.get_view_interval()) and t.label1.get_text()]
    assert texts and not all(PLAIN.match(text) for text in texts), texts
    plt.close(ax.figure)


@pytest.mark.parametrize("value, base, text", [
    (0.5, 10, "0.5"), (2, 10, "2"), (500, 10, "500"), (1000, 10, "1k"), (2e4, 10, "20k"), (1e9, 10, "1G"),
    (2e-5, 10, "20µ"), (0.001, 10, "0.001"), (4096, 2, "4096"), (0.25, 2, "0.25"), (2**21, 2, "2.09715M"),
])
def test_tick_label(value, base, text):
    assert plots.tick_label(value, base) == text


@pytest.mark.parametrize("intensity", [[0.5, 2, 8], [5, 50, 500, 5000], [100, 10_000, 1e6]])
def test_roofline_roofs_span_the_data_only_and_read_like_numbers(intensity):
    frame = pd.DataFrame({"precision": "fp32", "intensity": intensity, "tflops": [0.01 * (i + 1) for i in range(len(intensity))]})
    ax = plots.roofline(frame, peaks={"fp32": 0.05}, datasheet={"fp32": 0.08}, bandwidth_gbs=20)
    lo, hi = min(intensity), max(intensity)
    roofs = [line for line in ax.get_lines() if line.get_label() != "fp32"]
    assert roofs and all(lo <= x <= hi for line in roofs for x in line.get_xdata())
    _assert_readable(ax)
    plt.close(ax.figure)


def test_waterfall_climbs_only_on_kept_steps_and_ends_at_the_total():
    ax = plots.waterfall(["a", "b", "c"], [2.0, 0.8, 1.5], kept=[True, False, True])
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["2.00×", "0.80×", "1.50×", "3.00×"]  # the grey step does not count: 2 × 1.5
    bars = ax.patches
    assert bars[1].get_facecolor() != bars[0].get_facecolor()  # the dropped step is drawn differently
    assert bars[2].get_y() == pytest.approx(math.log(2.0))  # c starts where a left the level, not where b did
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "total"]
    assert "2×" in [t.get_text() for t in ax.get_yticklabels()]
    plt.close(ax.figure)


def test_waterfall_marks_a_step_dropped_for_its_accuracy_apart_from_one_not_faster():
    ax = plots.waterfall(["fast but wrong", "slower", "good"], [2.0, 0.9, 1.2], kept=[False, False, True],
                         accuracy_lost=[True, False, False])
    wrong, slower, good = ax.patches[:3]
    assert wrong.get_hatch() and not slower.get_hatch() and not good.get_hatch()
    assert len({wrong.get_facecolor(), slower.get_facecolor(), good.get_facecolor()}) == 3
    assert ax.texts[-1].get_text() == "1.20×"  # neither dropped step counts
    assert ax.get_ylim()[0] < math.log(0.9)  # a margin below the slower step's bar, not its bottom at the edge
    assert "dropped: accuracy fell" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(ax.figure)


def test_scaling_pairs_two_bounds_of_a_link_in_one_colour_and_two_line_styles():
    rows = [{"link": link, "bound": bound, "gpus": n, "efficiency": 1 / (1 + k * (n - 1) * (bound == "no overlap"))}
            for k, link in ((0.01, "fast"), (0.1, "slow")) for bound in ("no overlap", "overlapped") for n in (1, 2, 4)]
    ax = plots.scaling(pd.DataFrame(rows), linestyle_by="bound")
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"fast, no overlap", "fast, overlapped", "slow, no overlap", "slow, overlapped"}
    color = {label: line.get_color() for label, line in lines.items()}
    dash = {label: line.get_linestyle() for label, line in lines.items()}
    assert color["fast, no overlap"] == color["fast, overlapped"] != color["slow, no overlap"] == color["slow, overlapped"]
    assert dash["fast, no overlap"] == dash["slow, no overlap"] != dash["fast, overlapped"] == dash["slow, overlapped"]
    low, high = ax.get_xlim()
    ax.figure.canvas.draw()
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()
                                         if low <= t.get_position()[0] <= high and t.get_text()] == ["1", "2", "4"]
    plt.close(ax.figure)


def _overlaps(boxes) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_waterfall_draws_each_steps_spread_and_keeps_its_legend_off_the_bars():
    ax = plots.waterfall(["a", "b", "c"], [2.0, 1.02, 1.5], kept=[True, False, True],
                         intervals=[(1.8, 2.3), (0.9, 1.15), None])
    from matplotlib.container import ErrorbarContainer

    assert sum(isinstance(c, ErrorbarContainer) for c in ax.containers) == 2 and ax.texts[0].get_text() == "2.00×"
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(bar.get_window_extent(renderer)) for bar in ax.patches)
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert not _overlaps(labels) and all(ax.get_window_extent(renderer).contains(b.x0, b.y0) for b in labels)
    plt.close(ax.figure)


def test_speedups_show_the_interval_and_the_verdict_and_keep_labels_inside():
    from gpulab import Comparison

    comparisons = {"clear": Comparison.of([2.0] * 6, [1.0] * 6),
                   "noise": Comparison.of([1.0, 1.1, 0.9, 1.0, 1.05, 0.97], [1.0] * 6),
                   "slower": Comparison.of([1.0] * 6, [1.5] * 6)}
    ax = plots.speedups(comparisons, title="t")
    texts = [t.get_text() for t in ax.texts]
    assert texts[0].strip() == "2.00× (2.00–2.00×)" and "within noise" in texts[1] and "0.67×" in texts[2]
    colors = [bar.get_facecolor() for bar in ax.patches[:3]]
    assert len(set(colors)) == 3
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    assert all(frame.x0 <= t.get_window_extent(renderer).x1 <= frame.x1 + 1 for t in ax.texts)
    plt.close(ax.figure)


def test_bars_say_a_comparisons_spread_instead_of_a_bare_ratio_and_fit_their_labels():
    from gpulab import Comparison

    noisy = Comparison.of([2.0, 2.4, 0.9, 2.2, 1.2, 2.1], [1.0] * 6)
    ax = plots.bars({"slow": 2.0, "fast but noisy": 1.0}, baseline="slow", unit="ms", higher_is_better=False,
                    comparisons={"fast but noisy": noisy})
    assert "within noise (0.90–2.40×)" in ax.texts[1].get_text()
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    assert all(t.get_window_extent(renderer).x1 <= ax.get_window_extent(renderer).x1 + 1 for t in ax.texts)
    plt.close(ax.figure)


def _inside(ax) -> bool:
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    right = ax.get_window_extent(renderer).x1 + 1
    return all(t.get_window_extent(renderer).x1 <= right for t in ax.texts)


def test_relative_bars_and_top_operators_keep_their_labels_inside_the_axes():
    frame = pd.DataFrame({"how": ["baseline", "checkpointing every block"], "peak": [100.0, 35.0], "ms": [10.0, 14.2]})
    ax = plots.relative_bars(frame, {"peak": "peak memory (MiB)", "ms": "time per step (ms)"}, label="how",
                             baseline="baseline")
    assert _inside(ax) and all(t.get_bbox_patch() is not None for t in ax.texts)  # a background over the 1x line
    plt.close(ax.figure)
    table = pd.DataFrame({"operator": ["aten::addmm", "aten::a_very_long_operator_name_that_goes_on"],
                          "self_cpu_ms": [12.345678, 11.9]})
    ax = plots.top_operators(table)
    assert _inside(ax)
    plt.close(ax.figure)


def test_a_waterfall_names_what_a_dropped_step_lost():
    ax = plots.waterfall(["bf16"], [1.8], kept=[False], accuracy_lost=[True], lost_label="loss rose")
    assert "dropped: loss rose" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(ax.figure)
