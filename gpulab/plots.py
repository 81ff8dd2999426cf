"""The few figure kinds the course uses, in one style."""

import math
from contextlib import contextmanager

import matplotlib.pyplot as plt
from matplotlib import rcParams
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, Formatter, Locator, MaxNLocator, NullFormatter
from matplotlib.transforms import Bbox

STYLE = {
    "figure.figsize": (7, 4),
    "figure.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titleweight": "bold",
    "legend.frameon": False,
}


@contextmanager
def style():
    """The course's matplotlib style, for a ``with`` block.

    rc_context restores every rcParam on exit, ``interactive`` too; Jupyter's inline backend may switch
    that on inside the block, and turning it back off would stop later figures from being shown.
    """
    with plt.rc_context(STYLE):
        try:
            yield
        finally:
            interactive = plt.isinteractive()
    plt.interactive(interactive)


def _axes(ax):
    if ax is not None:
        return ax
    with style():
        return plt.figure().add_subplot()


def bars(values: dict, *, baseline: str | None = None, unit: str = "", higher_is_better: bool = True,
         comparisons: dict | None = None, title: str = "", ax=None):
    """Horizontal bars, one per label, each annotated with its value and its speed-up over ``baseline``.

    ``comparisons`` maps a label to its ``gpulab.Comparison`` against the baseline: its median speed-up, the
    interval and the verdict are written instead of the plain ratio of two values (which hides the noise).
    """
    ax = _axes(ax)
    labels, heights = list(values), [float(v) for v in values.values()]
    base = values[baseline] if baseline is not None else None
    comparisons = comparisons or {}
    with style():
        colors = ["tab:gray" if label == baseline else "tab:blue" for label in labels]
        ax.barh(labels, heights, color=colors)
        ax.invert_yaxis()
        texts = []
        for i, (label, value) in enumerate(zip(labels, heights)):
            text = f" {value:.3g} {unit}"
            if label in comparisons:
                text += f"  ({speedup_text(comparisons[label])})"
            elif base:
                speedup = value / base if higher_is_better else base / value
                text += f"  ({speedup:.2f}×)"
            texts.append(ax.text(value, i, text, va="center"))
        ax.set_xlim(0, max(heights) * 1.05 if heights else 1)
        ax.set_xlabel(unit)
        ax.set_title(title)
        fit_labels(ax, texts)
    return ax


def speedup_text(comparison) -> str:
    """"1.84× (1.70–1.95×)", or "1.03×, within noise (0.95–1.10×)": a speed-up never without its spread."""
    low, high = comparison.interval
    noise = ", within noise" if comparison.verdict == "within noise" else ""
    return f"{comparison.speedup:.2f}×{noise} ({low:.2f}–{high:.2f}×)"


_LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1}  # readable over grid and 1× lines
_VERDICT_COLORS = {"faster": "tab:green", "slower": "tab:red", "within noise": "0.6"}


def speedups(comparisons, *, title: str = "", ax=None):
    """Speed-ups with their spread: one bar per ``gpulab.Comparison`` (a list, or a dict whose keys name them),
    its median ratio with the interval as an error bar, green when faster, red when slower, grey within noise;
    a line at 1×."""
    ax = _axes(ax)
    named = list(comparisons.items()) if isinstance(comparisons, dict) else [
        (f"{c.candidate} vs {c.baseline}", c) for c in comparisons]
    names, values = [n for n, _ in named], [c for _, c in named]
    with style():
        errors = list(zip(*(c.errorbar() for c in values))) if values else None
        ax.barh(names, [c.speedup for c in values], xerr=errors, capsize=3, ecolor="0.25",
                color=[_VERDICT_COLORS[c.verdict] for c in values])
        ax.axvline(1, color="0.3", linestyle="--", linewidth=1)
        ax.invert_yaxis()
        texts = [ax.text(c.interval[1], i, f"  {speedup_text(c)}", va="center", fontsize="small", bbox=_LABEL_BOX)
                 for i, c in enumerate(values)]
        ax.set_xlim(0, max([c.interval[1] for c in values] + [1]) * 1.05)
        ax.set_xlabel("speed-up (×), median of interleaved pairs with its interval")
        ax.set_title(title)
        ax.legend(handles=[Patch(color=color, label=verdict) for verdict, color in _VERDICT_COLORS.items()],
                  fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fit_labels(ax, texts)
    return ax


def fit_labels(ax, texts, *, axis: str = "x") -> None:
    """Widen the data limits (linear axes) until every text lies inside the axes: a label never runs into the
    next panel. A text keeps its place in data coordinates and its size in pixels, so the upper limit needed is
    low + (start − low) / (1 − size / axes size) for each text."""
    if not texts:
        return
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    along = 0 if axis == "x" else 1
    low, high = ax.get_xlim() if axis == "x" else ax.get_ylim()
    span_px = frame.width if axis == "x" else frame.height
    needed = high
    for text in texts:
        box = text.get_window_extent(renderer)
        start = ax.transData.inverted().transform((box.x0, box.y0))[along]
        size_px = box.width if axis == "x" else box.height
        if size_px < 0.9 * span_px:
            needed = max(needed, low + (start - low) / (1 - size_px / span_px) * 1.02)
    (ax.set_xlim if axis == "x" else ax.set_ylim)(low, needed)


def curves(frame, x: str, y: str, *, by: str | None = None, logx: bool = True, logy: bool = True,
           title: str = "", xlabel: str | None = None, ylabel: str | None = None, ax=None, **plot_kwargs):
    """One line per value of column ``by`` (or a single line): ``y`` against ``x``."""
    ax = _axes(ax)
    groups = frame.groupby(by, sort=False) if by else [(y, frame)]
    with style():
        for name, group in groups:
            group = group.sort_values(x)
            ax.plot(group[x], group[y], marker="o", label=str(name), **plot_kwargs)
        if logx:
            log_scale(ax, "x", base=2 if frame[x].max() / frame[x].min() <= 2**12 else 10)
        if logy:
            log_scale(ax, "y")
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        ax.set_title(title)
        if by:
            ax.legend()
    return ax


def log_scale(ax, axis: str = "x", *, base: int = 10):
    """A log scale on ``ax``'s ``axis`` ("x" or "y") whose ticks read like numbers: 1, 2, 5, 10, 100, 1k, 20µ
    (powers of two written out with ``base=2``), never 5.6×10⁻¹, and only as many labels as fit side by side.

    Use it instead of ``ax.set_xscale("log")``, which brings back matplotlib's own labels.
    """
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=base)
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(ReadableLogLocator(base))
    target.set_major_formatter(ReadableFormatter(base))
    target.set_minor_formatter(NullFormatter())
    return ax


def tick_label(value: float, base: int = 10) -> str:
    """A log axis' tick label: 0.5, 2, 50 as they are; 1k, 20M, 500µ, 2n in engineering notation.

    With ``base=2``, whole numbers below a million are written out (1024, 4096), as powers of two are.
    """
    if value <= 0:
        return f"{value:g}"
    if 1e-3 <= value < 1e3 or (base == 2 and value < 1e6 and float(value).is_integer()):
        return f"{value:.6g}"
    return _ENG(value)


_ENG = EngFormatter(sep="")


class ReadableFormatter(Formatter):
    """Major tick labels of a log axis, by ``tick_label``."""

    def __init__(self, base: int = 10):
        self.base = base

    def __call__(self, value, pos=None):
        return tick_label(value, self.base)


class ReadableLogLocator(Locator):
    """Ticks of a log axis at the densest of these whose labels fit side by side: 1-2-5 steps (1, 2, 5, 10, 20,
    ...), 1-3 steps (1, 3, 10, 30) where fewer than three powers are in view, every power of the base, every
    2nd, 3rd, ... power. Over a range too narrow for two such ticks, the multiples in between (3, 4, 6, ...),
    or evenly spaced values."""

    def __init__(self, base: int = 10):
        self.base = base

    def __call__(self):
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin, vmax):
        vmin, vmax = sorted((vmin, vmax))
        if not (vmin > 0 and math.isfinite(vmax)):
            return []
        low, high = math.floor(math.log(vmin, self.base)) - 1, math.ceil(math.log(vmax, self.base)) + 1
        powers = [float(self.base) ** k for k in range(low, high + 1)]
        steps = [p * m for p in powers for m in ((1, 2, 5) if self.base == 10 else (1,))]
        if len(_within(steps, vmin, vmax)) < 2:  # a narrow range
            between = [p * m for p in powers for m in range(1, self.base)]
            if len(_within(between, vmin, vmax)) < 2:
                return MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin, vmax)
            return between if self._fit(between, vmin, vmax) else between[::2]
        if self._fit(steps, vmin, vmax):
            return steps
        thirds = [p * m for p in powers for m in (1, 3)]  # 1, 3, 10, 30: evenly spaced, half a power apart
        if self.base == 10 and len(_within(powers, vmin, vmax)) < 3 and self._fit(thirds, vmin, vmax):
            return thirds
        every = 1  # every n-th power: those whose exponent is a multiple of n, wherever the range starts
        while not self._fit(ticks := powers[-low % every::every], vmin, vmax):
            every += 1
        return ticks

    def _fit(self, ticks, vmin, vmax) -> bool:
        """Whether the labels of ``ticks`` would stand apart on this axis (True when no axis is attached)."""
        ticks = _within(ticks, vmin, vmax)
        if self.axis is None or len(ticks) < 2:
            return True
        name = self.axis.axis_name
        size = FontProperties(size=rcParams[f"{name}tick.labelsize"]).get_size_in_points()
        box = Bbox.unit().transformed(self.axis.axes.transAxes - self.axis.get_figure(root=False).dpi_scale_trans)
        if name == "x":  # a label is about 0.65 em per character wide; leave 1.2 em between labels
            length, needed = box.width * 72, size * (0.65 * max(len(tick_label(t, self.base)) for t in ticks) + 1.2)
        else:  # a label is about 1.2 em high; leave as much between labels
            length, needed = box.height * 72, size * 2.4
        log = [math.log(t, self.base) for t in ticks]
        closest = min(b - a for a, b in zip(log, log[1:]))  # 1-2-5 steps are uneven: the tightest pair counts
        return closest / math.log(vmax / vmin, self.base) * length >= needed


def _within(ticks, vmin, vmax):
    return [t for t in ticks if vmin * (1 - 1e-9) <= t <= vmax * (1 + 1e-9)]


def overlay_reference(ax, reference, x: str, y: str, *, by: str | None = None):
    """Draw reference rows (``gpulab.reference_for(...)``) on ``ax`` as dashed lines, one per GPU and ``by`` group.

    The title, axis labels, scales and the learner's own lines stay as they are; the legend gains the
    reference lines. An empty frame draws nothing.
    """
    if reference is None or reference.empty:
        return ax
    keys = ["device_name"] + ([by] if by else [])
    with style():
        for key, group in reference.groupby(keys, sort=False):
            name = " · ".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))
            group = group.sort_values(x)
            ax.plot(group[x], group[y], linestyle="--", marker=".", alpha=0.8, label=f"{name} (reference)")
        ax.legend()
    return ax


def mark(ax, x: float, text: str, color: str = "tab:red"):
    """A labelled vertical line (a crossover, a knee, a limit)."""
    ax.axvline(x, color=color, linestyle="--", linewidth=1)
    ax.annotate(text, (x, 0.95), xycoords=("data", "axes fraction"), ha="left", va="top", color=color,
                xytext=(4, 0), textcoords="offset points")
    return ax


def hline(ax, y: float, text: str, color: str = "tab:red"):
    """A labelled horizontal line (a theoretical peak, a link's bandwidth)."""
    ax.axhline(y, color=color, linestyle="--", linewidth=1)
    ax.annotate(text, (0.01, y), xycoords=("axes fraction", "data"), ha="left", va="bottom", color=color)
    return ax


def timeline(spans, *, title: str = "", ax=None):
    """GPU work over time, one row per lane (a stream), one colour per kind of work (copy, compute).

    ``spans`` has columns lane, kind, start_ms, end_ms (``gpulab.transfers.Timeline.frame()``).
    Bars that sit above each other ran at the same time.
    """
    from matplotlib.patches import Patch

    ax = _axes(ax)
    lanes, kinds = list(dict.fromkeys(spans["lane"])), list(dict.fromkeys(spans["kind"]))
    colors = {kind: f"C{i}" for i, kind in enumerate(kinds)}
    with style():
        for row, lane in enumerate(lanes):
            for kind, group in spans[spans["lane"] == lane].groupby("kind", sort=False):
                bars = list(zip(group["start_ms"], group["end_ms"] - group["start_ms"], strict=True))
                ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colors[kind], edgecolor="white", linewidth=0.5)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel("time on the GPU (ms)")
        ax.legend(handles=[Patch(color=colors[k], label=k) for k in kinds], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title)
    return ax


def utilisation(samples, column: str = "gpu_util_pct", *, ylabel: str = "GPU utilisation (%)", title: str = "",
                ax=None):
    """A monitor's samples over time (``gpulab.monitor.Monitor.frame()``), each phase shaded and named."""
    ax = _axes(ax)
    with style():
        if samples.empty:
            ax.text(0.5, 0.5, "no samples (NVML is not available here)", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
        else:
            ax.plot(samples["time_s"], samples[column], color="tab:blue", linewidth=1.2)
            phase = samples["phase"].fillna("").astype(str)
            runs = (phase != phase.shift()).cumsum()
            starts = samples["time_s"].groupby(runs).first()
            ends = list(starts.iloc[1:]) + [samples["time_s"].iloc[-1]]
            names = phase.groupby(runs).first()
            named = [(start, end, name) for start, end, name in zip(starts, ends, names, strict=True) if name]
            for i, (start, end, name) in enumerate(named):
                ax.axvspan(start, end, color="0.85" if i % 2 == 0 else "0.93", linewidth=0, zorder=0)
                ax.annotate(name, ((start + end) / 2, 1.01), xycoords=("data", "axes fraction"), ha="left",
                            va="bottom", rotation=30, fontsize=8)
        if column.endswith("_pct"):
            ax.set_ylim(0, 105)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, pad=40 if not samples.empty else None)
    return ax


def roofline(frame, *, peaks: dict | None = None, datasheet: dict | None = None, bandwidth_gbs: float | None = None,
             x: str = "intensity", y: str = "tflops", by: str = "precision", title: str = "", ax=None):
    """A roofline: measured TFLOP/s against arithmetic intensity (FLOP/byte), one line per ``by`` group.

    Roofs in each group's colour: ``peaks`` (measured, dashed) and ``datasheet`` (vendor figures, dotted),
    both {group: TFLOP/s}; ``bandwidth_gbs`` draws the memory roof, bandwidth × intensity.
    """
    from matplotlib.lines import Line2D

    ax = _axes(ax)
    with style():
        colors = {}
        for name, group in frame.groupby(by, sort=False):
            group = group.sort_values(x)
            (line,) = ax.plot(group[x], group[y], marker="o", label=str(name))
            colors[name] = line.get_color()
        roofs, lo, hi = [], frame[x].min(), frame[x].max()  # every roof spans the data's intensities only
        for values, linestyle in ((peaks or {}, "--"), (datasheet or {}, ":")):
            for name, value in values.items():
                if value and value == value:  # skip None and NaN
                    ax.plot([lo, hi], [value, value], color=colors.get(name, "gray"), linestyle=linestyle,
                            linewidth=1.2, label="_roof")
                    roofs.append(value)
        handles, _ = ax.get_legend_handles_labels()
        if bandwidth_gbs and bandwidth_gbs == bandwidth_gbs:
            top = max(roofs + [frame[y].max()])
            hi = min(hi, top * 1e3 / bandwidth_gbs)  # the slope ends where it meets the highest roof
            if hi > lo:
                xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
                ys = [bandwidth_gbs * v / 1e3 for v in xs]  # GB/s × FLOP/byte = GFLOP/s; /1e3 → TFLOP/s
                (memory,) = ax.plot(xs, ys, color="black", linestyle="-.", linewidth=1,
                                    label=f"memory roof ({bandwidth_gbs:,.0f} GB/s copy)")
                handles.append(memory)
        if peaks:
            handles.append(Line2D([], [], color="gray", linestyle="--", label="measured peak (fastest matmul)"))
        if datasheet and any(v and v == v for v in datasheet.values()):
            handles.append(Line2D([], [], color="gray", linestyle=":", label="datasheet peak (vendor)"))
        log_scale(ax, "x")
        log_scale(ax, "y")
        ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title)
        ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax


def trace_timeline(spans, *, steps=None, title: str = "", ax=None):
    """A profiler trace as a timeline (``gpulab.traces.timeline_spans``): CPU ranges and GPU work, one row per
    thread or stream, with the training steps' boundaries (``gpulab.traces.steps``) as dotted lines.
    White space on a GPU row is time the GPU sat idle."""
    if ax is None:
        with style():
            ax = plt.figure(figsize=(12, 1.5 + 0.5 * spans["lane"].nunique())).add_subplot()
    timeline(spans, title=title, ax=ax)
    with style():
        ax.set_xlabel("time since the trace began (ms)")
        for step in (steps.itertuples() if steps is not None else []):
            ax.axvline(step.start_ms, color="0.3", linestyle=":", linewidth=1)
            ax.annotate(f"step {step.step}", (step.start_ms, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, 2), textcoords="offset points", fontsize=8, color="0.3")
        if steps is not None and len(steps):
            ax.set_title(title, pad=14)  # above the step labels
    return ax


def top_operators(table, column: str = "self_cpu_ms", *, n: int = 10, title: str = "", ax=None):
    """The ``n`` operators of a profile table (``gpulab.traces.op_table``) with the most ``column``, as bars."""
    rows = table.sort_values(column, ascending=False).head(n)
    ax = _axes(ax)
    with style():
        names = [name if len(name) <= 45 else name[:44] + "…" for name in rows["operator"]]
        ax.barh(names, rows[column], color="tab:blue")
        ax.invert_yaxis()
        texts = [ax.text(value, i, f" {value:.3g}", va="center", fontsize=8) for i, value in enumerate(rows[column])]
        ax.set_xlim(0, rows[column].max() * 1.05 if len(rows) and rows[column].max() > 0 else 1)
        ax.set_xlabel(column)
        ax.set_title(title)
        fit_labels(ax, texts)
    return ax


def stacked(frame, columns, *, label: str, unit: str = "ms", title: str = "", ax=None):
    """Horizontal stacked bars: one bar per row of ``frame`` (named by column ``label``), one segment per column
    in ``columns`` (where a step's time went, per configuration)."""
    ax = _axes(ax)
    with style():
        left = [0.0] * len(frame)
        for column in columns:
            values = frame[column].astype(float).tolist()
            ax.barh(frame[label].astype(str), values, left=left, label=column)
            left = [a + b for a, b in zip(left, values)]
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title)
    return ax


def predicted_vs_measured(frame, parts, *, label: str, unit: str = "MiB", title: str = "", ax=None):
    """Where memory (or time) went, predicted on paper and measured: for each value of column ``label``, a hatched
    bar from the row whose ``source`` is "predicted" above a solid one from the row whose ``source`` is
    "measured", each stacked from the columns ``parts`` (one colour per part), the measured bar annotated with
    its total and measured / predicted."""
    from matplotlib.patches import Patch

    ax = _axes(ax)
    names = list(dict.fromkeys(frame[label]))
    with style():
        totals = []
        for row, name in enumerate(names):
            for source, offset, hatch, alpha in (("predicted", -0.2, "//", 0.45), ("measured", 0.2, None, 1.0)):
                match = frame[(frame[label] == name) & (frame["source"] == source)]
                if match.empty:
                    continue
                left = 0.0
                for i, part in enumerate(parts):
                    value = float(match[part].iloc[0])
                    ax.barh(row + offset, value, height=0.38, left=left, color=f"C{i}", alpha=alpha, hatch=hatch,
                            edgecolor="white", linewidth=0.5)
                    left += value
                totals.append(left)
                if source == "measured":
                    predicted = frame[(frame[label] == name) & (frame["source"] == "predicted")]
                    ratio = left / predicted[list(parts)].iloc[0].sum() if not predicted.empty else float("nan")
                    text = f" {left:.3g} {unit}" + (f" ({ratio:.2f}× predicted)" if ratio == ratio else "")
                    ax.text(left, row + offset, text, va="center", fontsize=8)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.grid(axis="y", visible=False)
        ax.set_xlim(0, max(totals, default=1) * 1.45)
        ax.set_xlabel(unit)
        handles = [Patch(color=f"C{i}", label=part) for i, part in enumerate(parts)]
        handles += [Patch(facecolor="0.8", hatch="//", edgecolor="white", label="predicted (upper bar)"),
                    Patch(color="0.5", label="measured (lower bar)")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        ax.set_title(title)
    return ax


def memory_timeline(events, *, title: str = "", ax=None):
    """Memory alive after each allocation event, in MiB (``gpulab.memory.MemoryTracker.timeline()`` or
    ``gpulab.memory.snapshot_timeline``): ``allocated``, and ``reserved`` where the frame has it; each named
    ``phase`` shaded and labelled, out-of-memory events marked."""
    ax = _axes(ax)
    with style():
        x = events["event"]
        ax.step(x, events["allocated"] / 2**20, where="post", color="tab:blue", label="allocated")
        if "reserved" in events:
            ax.step(x, events["reserved"] / 2**20, where="post", color="tab:orange", label="reserved")
        phase = events["phase"].fillna("").astype(str)
        runs = (phase != phase.shift()).cumsum()
        starts, names = x.groupby(runs).first(), phase.groupby(runs).first()
        ends = list(starts.iloc[1:]) + [x.iloc[-1]]
        named = [(start, end, name) for start, end, name in zip(starts, ends, names, strict=True) if name]
        for i, (start, end, name) in enumerate(named):
            ax.axvspan(start, end, color="0.85" if i % 2 == 0 else "0.93", linewidth=0, zorder=0)
            ax.annotate(name, ((start + end) / 2, 1.01), xycoords=("data", "axes fraction"), ha="left",
                        va="bottom", rotation=30, fontsize=8)
        ooms = events[events["action"] == "oom"]
        if not ooms.empty:
            ax.scatter(ooms["event"], ooms["allocated"] / 2**20, color="tab:red", marker="x", zorder=3,
                       label="out of memory")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("allocation events, in order")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title, pad=40 if named else None)
    return ax


def tradeoff(frame, x: str, y: str, *, label: str, title: str = "", xlabel: str | None = None,
             ylabel: str | None = None, ax=None):
    """One labelled point per row, ``y`` against ``x`` (peak memory against step time, say), joined in the
    frame's order; both axes start at zero, so distances read as proportions."""
    ax = _axes(ax)
    with style():
        ax.plot(frame[x], frame[y], color="0.75", linestyle=":", zorder=1)
        for i, row in enumerate(frame.itertuples(index=False)):
            px, py = getattr(row, x), getattr(row, y)
            ax.scatter([px], [py], color=f"C{i}", zorder=3)
            ax.annotate(str(getattr(row, label)), (px, py), xytext=(5, 4), textcoords="offset points", fontsize=9)
        ax.set_xlim(0, frame[x].max() * 1.25)
        ax.set_ylim(0, frame[y].max() * 1.2)
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        ax.set_title(title)
    return ax


def relative_bars(frame, metrics: dict, *, label: str, baseline: str, title: str = "", ax=None):
    """Several metrics of several configurations in one chart: for each row (named by column ``label``), one bar
    per metric (``metrics`` maps a column to its name with unit, "peak memory (MiB)") as a multiple of the
    ``baseline`` row's, annotated with its own value. 1× is the baseline."""
    ax = _axes(ax)
    rows = frame.reset_index(drop=True)
    base = rows[rows[label] == baseline].iloc[0]
    height = 0.8 / len(metrics)
    texts = []
    with style():
        for i, (column, name) in enumerate(metrics.items()):
            ratios = rows[column] / base[column]
            positions = [r - 0.4 + (i + 0.5) * height for r in range(len(rows))]
            ax.barh(positions, ratios, height=height, color=f"C{i}", label=name)
            texts += [ax.text(ratio, pos, f" {ratio:.2f}× ({value:.3g})", va="center", fontsize=8, bbox=_LABEL_BOX)
                      for pos, ratio, value in zip(positions, ratios, rows[column])]
        ax.axvline(1, color="0.3", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(rows)), rows[label].astype(str))
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.grid(axis="y", visible=False)
        ax.set_xlim(0, max(float((rows[c] / base[c]).max()) for c in metrics) * 1.05)
        ax.set_xlabel(f"× {baseline}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title)
        fit_labels(ax, texts)
    return ax


def regimes(ax, boundary: float, left: str = "latency-bound", right: str = "bandwidth-bound"):
    """Shade the part of the x axis left of ``boundary`` and name the regime on each side of it (a collective's
    latency-bound small messages vs its bandwidth-bound large ones)."""
    lo, hi = ax.get_xlim()
    with style():
        ax.axvspan(lo, boundary, color="0.92", linewidth=0, zorder=0)
        ax.axvline(boundary, color="0.5", linestyle=":", linewidth=1)
        for text, ha, dx in ((left, "right", -4), (right, "left", 4)):
            ax.annotate(text, (boundary, 0.03), xycoords=("data", "axes fraction"), xytext=(dx, 0),
                        textcoords="offset points", ha=ha, va="bottom", color="0.35", fontsize="small")
    ax.set_xlim(lo, hi)
    return ax


def scaling(frame, *, x: str = "gpus", y: str = "efficiency", by: str = "link", linestyle_by: str | None = None,
            measured=None, title: str = "", ax=None):
    """Scaling efficiency against GPU count, one line per ``by`` group (a model's predictions), 1 = perfect.

    ``linestyle_by`` (a column) draws each of its values in its own line style, in its ``by`` group's colour, so
    that two bounds of one link read as a pair. ``measured`` (same columns) adds measured points in black; GPU
    counts are written out (1, 2, 4, 8, ...).
    """
    ax = _axes(ax)
    colors = {name: f"C{i}" for i, name in enumerate(frame[by].unique())}
    styles = dict(zip(frame[linestyle_by].unique(), ("-", "--", ":", "-."))) if linestyle_by else {None: "-"}
    keys = [by, linestyle_by] if linestyle_by else [by]
    with style():
        for key, group in frame.groupby(keys, sort=False):
            name, kind = key[0], (key[1] if linestyle_by else None)
            group = group.sort_values(x)
            ax.plot(group[x], group[y], marker="o", color=colors[name], linestyle=styles[kind],
                    label=f"{name}, {kind}" if linestyle_by else str(name))
        ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1)
        if measured is not None and not measured.empty:
            ax.plot(measured[x], measured[y], "k*", markersize=11, label="measured")
        log_scale(ax, "x", base=2)
        ax.set(xlabel="GPUs (data-parallel ranks)", ylabel="scaling efficiency", ylim=(0, 1.1), title=title)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the lines, not on them
    return ax


_KEPT = {"color": "tab:green"}
_NOT_FASTER = {"color": "0.75"}
_ACCURACY_LOST = {"facecolor": "#f4b6b6", "edgecolor": "tab:red", "hatch": "//"}
_WATERFALL_TICKS = (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def waterfall(steps, ratios, *, kept=None, accuracy_lost=None, intervals=None,
              lost_label: str | None = "accuracy fell", title: str = "", ax=None,
              kept_label: str = "kept: faster, accuracy kept"):
    """A waterfall of speed-ups: one floating bar per step from the level before it to that level × its ``ratio``
    (its speed over the configuration before it), then the total. Steps not ``kept`` leave the level where it was:
    grey when they were not faster, hatched red where ``accuracy_lost`` says they cost accuracy (or what
    ``lost_label`` names: "loss differs"; None where no step is judged so; ``kept_label`` then says what a kept
    step kept). ``intervals`` ((low, high) per step, or None) draw each ratio's spread as an error bar at the top of
    its bar. The y axis is logarithmic: speed-ups multiply. The legend sits beside the axes, never on a bar."""
    ax = _axes(ax)
    kept = [True] * len(steps) if kept is None else list(kept)
    accuracy_lost = [False] * len(steps) if accuracy_lost is None else list(accuracy_lost)
    intervals = [None] * len(steps) if intervals is None else list(intervals)
    level = 1.0
    with style():
        for i, (ratio, keep, lost, spread) in enumerate(zip(ratios, kept, accuracy_lost, intervals)):
            top = level * ratio
            look = _KEPT if keep else _ACCURACY_LOST if lost else _NOT_FASTER
            ax.bar(i, abs(math.log(top / level)), bottom=math.log(min(level, top)), width=0.7, **look)
            label_at = max(level, top)
            if spread is not None:
                low, high = (math.log(level * r) for r in spread)
                ax.errorbar(i, math.log(top), yerr=[[math.log(top) - low], [high - math.log(top)]], color="0.2",
                            capsize=3, linewidth=1)
                label_at = max(label_at, level * spread[1])
            ax.annotate(f"{ratio:.2f}×", (i, math.log(label_at)), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize="small")
            level = top if keep else level
        ax.bar(len(steps), math.log(level), bottom=0, width=0.7, color="tab:blue")
        ax.annotate(f"{level:.2f}×", (len(steps), math.log(max(level, 1))), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontweight="bold")
        ax.axhline(0, color="0.4", linewidth=1)
        for bar in ax.patches:  # a bar's bottom is sticky by default: leave a margin below a step that lost speed
            bar.sticky_edges.y.clear()
        ax.autoscale_view()
        ax.set_xticks(range(len(steps) + 1), [*steps, "total"], rotation=35, ha="right")
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.08 * (high - low))  # room for the labels above the highest bar
        low, high = ax.get_ylim()
        ticks = [t for t in _WATERFALL_TICKS if low - 1e-9 <= math.log(t) <= high + 1e-9]
        ticks = ticks[:: max(1, math.ceil(len(ticks) / 8))]  # at most 8 labels
        ax.set_yticks([math.log(t) for t in ticks], [f"{t:g}×" for t in ticks])
        lost = [Patch(**_ACCURACY_LOST, label=f"dropped: {lost_label}")] if lost_label else []  # None: not judged
        ax.legend(handles=[Patch(**_KEPT, label=kept_label),
                           Patch(**_NOT_FASTER, label="dropped: not faster beyond the noise"), *lost,
                           Patch(color="tab:blue", label="all kept steps")], fontsize="small", loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))
        ax.set_ylabel("speed-up over the naive baseline")
        ax.set_title(title)
    return ax
