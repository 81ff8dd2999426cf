"""Lesson 07's figures: the collectives against the message size, scaling efficiency measured with its interval, and
the scaling model's projection to GPU clusters beside the points measured. Each draws what a cell computed."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .. import plots
from .collectives import TOPOLOGIES, ring_allreduce_seconds
from .scaling import scaling_table


def collectives(frame, link, n: int, reference=None):
    """Left: the time of each collective against the message size, with the ring model fitted to the all-reduces;
    right: the bus bandwidth each rank's link carried. The shaded part is latency-bound."""
    frame = frame.assign(KiB=frame.bytes / 1024)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    plots.curves(frame, "KiB", "seconds", by="op", ax=left, xlabel="message size (KiB)", ylabel="time per call (s)",
                 title=f"collectives on {n} ranks ({frame.backend.iloc[0]})")
    sizes = np.geomspace(frame.bytes.min(), frame.bytes.max(), 50)
    left.plot(sizes / 1024, [ring_allreduce_seconds(s, n, link) for s in sizes], "k:", label="ring model, fitted")
    left.legend()
    plots.curves(frame, "KiB", "busbw_GBs", by="op", ax=right, logy=False, xlabel="message size (KiB)",
                 ylabel="bus bandwidth (GB/s)", title="bus bandwidth: what each rank's link carried")
    for ax in (left, right):
        plots.regimes(ax, link.crossover_bytes(n) / 1024)
    if reference is not None and not reference.empty:
        plots.overlay_reference(right, reference.assign(KiB=reference["bytes"] / 1024), "KiB", "busbw_GBs", by="op")
    return fig


def efficiency(frame, *, title: str, ax=None):
    """Scaling efficiency against ranks: the median of interleaved pairs with its 90 % interval, and perfect
    scaling (columns ``ranks``, ``efficiency``, ``efficiency_low``, ``efficiency_high``)."""
    ax = ax or plt.gca()
    ax.errorbar(frame.ranks, frame.efficiency, yerr=[frame.efficiency - frame.efficiency_low,
                                                     frame.efficiency_high - frame.efficiency],
                fmt="o-", capsize=4, label="measured: median of interleaved pairs, 90 % interval")
    ax.axhline(1, color="k", linestyle=":", label="perfect scaling")
    ax.set(xlabel="ranks", ylabel="scaling efficiency", xticks=frame.ranks, title=title,
           ylim=(0, max(1.15, frame.efficiency_high.max() * 1.1)))
    ax.legend(loc="lower left")
    return ax


def projection(table, measured, *, inputs, marks: dict, title: str, measured_label: str):
    """Left: the scaling model's efficiency on 1–64 GPUs (``table``: ``scaling_table`` rows with an ``estimate``
    column) and the points ``measured`` here with their intervals. Right: the model's efficiency at 64 GPUs
    (overlapped) against the compute time per step, for the same gradients (``inputs``: compute, overhead,
    backward share and gradient bytes), one line per topology; ``marks`` (label → seconds) draws the compute
    measured here."""
    _, overhead, backward, grad_bytes = inputs
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), layout="constrained")
    plots.scaling(table, linestyle_by="estimate", measured=measured, ax=left, title=title)
    left.errorbar(measured.gpus, measured.efficiency, yerr=[measured.efficiency - measured.efficiency_low,
                                                           measured.efficiency_high - measured.efficiency],
                  fmt="none", ecolor="k", capsize=3)
    handles, labels = left.get_legend_handles_labels()
    left.get_legend().remove()
    fig.legend(handles, [measured_label if label == "measured" else label for label in labels],
               loc="outside lower center", ncols=2, fontsize="small")
    computes = np.geomspace(1e-4, 10, 60)
    for i, topology in enumerate(TOPOLOGIES):
        if topology.fits(64):
            at_64 = [scaling_table(c, grad_bytes, [64], links=[topology], overlap=backward,
                                   overhead_s=overhead).efficiency.iloc[0] for c in computes]
            right.plot(computes, at_64, color=f"C{i}", label=topology.name)
    plots.log_scale(right, "x")
    for i, (label, seconds) in enumerate(marks.items()):
        right.axvline(seconds, color="k", linestyle=(":", "--")[i % 2])
        right.annotate(label, (seconds, 0.5 - 0.2 * i), xytext=(4, 0), textcoords="offset points", fontsize="small")
    right.set(xlabel="compute time per step (s)", ylabel="estimated efficiency at 64 GPUs", ylim=(0, 1.05),
              title="64 GPUs (8 nodes), overlapped: compute per step vs communication")
    right.legend(fontsize="small", loc="lower right")
    return fig


def bytes_held(held, parts, *, title: str):
    """What one rank holds under each strategy: the predicted bar above the measured (on a GPU) or counted (on a
    CPU) one, stacked from ``parts`` (columns in bytes; ``predicted_<part>`` beside each)."""
    source = held.source.iloc[0]
    bars = [held.assign(source="predicted", **{p: held[f"predicted_{p}"] / 2**20 for p in parts}),
            held.assign(source="measured", **{p: held[p].fillna(0) / 2**20 for p in parts})]
    ax = plots.predicted_vs_measured(pd.concat(bars), parts, label="config", unit="MiB per rank", title=title)
    if source == "counted":  # the lower bars are counts of tensors, not a measurement: the legend says so
        ax.get_legend().get_texts()[-1].set_text("counted from tensors (lower bar)")
    return ax
