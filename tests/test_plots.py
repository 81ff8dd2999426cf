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
