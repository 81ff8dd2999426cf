import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402

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
