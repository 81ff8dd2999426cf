"""Lesson 03's plumbing: the MFU of each model's training steps as columns of its rows and in a few words, and the
lesson's tables and figures. The steps, the searches and the accumulation stay in the lesson's cells."""

import math

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.ticker import PercentFormatter

from . import flops, plots
from .comparison import Comparison
from .device import device_info, get_device
from .results import reference_provenance

SHARE_NAMES = {"mfu": "MFU (dense peak of its precision)", "of_achievable": "of achievable (ceiling measured here)"}
GROWTH = 2.0  # a step's MFU is shown from the batch whose step, and every larger one's, takes this many times the
# model's shortest step of the sweep: from there at least half of a step grows with the batch


class Utilisation:
    """Each model's FLOPs per training sample (``flops.training_flops``, counted once), the precision its fp32 step
    runs in here, and the ceilings measured in those precisions: a model's MFU at a rate of samples/s."""

    def __init__(self, device=None):
        self.device = get_device(device)
        self.work: dict[str, tuple[float, str]] = {}  # model name -> (FLOPs a sample, precision)
        self.ceilings: dict[str, flops.Ceiling] = {}

    def count(self, name: str, model: torch.nn.Module, x, y, loss_fn) -> str:
        """Count ``model``'s training FLOPs on the batch ``x``, ``y``; what was counted, in a sentence."""
        counted = flops.training_flops(model, x, y, loss_fn=loss_fn)
        convolutions = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
        # TF32 where the switch allows it: cuDNN's (on by default) for convolutions, the matmuls' (off by default)
        precision = flops.precision_of(None, convolutions=convolutions, device=self.device)
        self.work[name] = (counted.total / len(x), precision)
        kinds = "convolutions and matmuls" if convolutions else "matmuls"
        return (f"{name}: {self.work[name][0] / 1e6:.3g} MFLOP per training sample (FlopCounterMode over a forward and "
                f"backward pass of {len(x)} samples: its {kinds}); its step runs in {precision}")

    def measure(self) -> list[str]:
        """The ceilings of the precisions counted (measured once per process), each in a line."""
        self.ceilings = flops.ceilings(sorted({p for _, p in self.work.values()}), device=self.device)
        return [f"measured here: {c}" + ("" if c.datasheet_tflops else
                f"; no vendor {c.precision} peak for {device_info(self.device).name}, and MFU needs one: this lesson "
                "shows the share of this ceiling instead") for c in self.ceilings.values()]

    def __call__(self, name: str, samples_per_s: float) -> flops.Utilisation:
        """.mfu over the vendor's dense peak of the step's precision (NaN without one), .of_achievable over the best
        ceiling measured here in it (measured again when a step beat it)."""
        per_sample, precision = self.work[name]
        return flops.mfu(per_sample, 1 / samples_per_s, flops.ceiling(precision, self.device), precision=precision)

    def columns(self, name: str, samples_per_s: float) -> dict:
        """A step's utilisation as columns of a results row: MFU and of achievable with their denominators, both NaN
        where a figure was above 100 % (``mfu_warning`` says why)."""
        u = self(name, samples_per_s)
        return ({"flops_per_sample": self.work[name][0]} | {k: v for k, v in u.row().items()
                                                            if k not in ("precision", "hfu")}
                | {"ceiling_precision": u.precision})


def launch_bound(curve: pd.DataFrame) -> pd.Series:
    """The rows of a sweep whose step time the fixed cost of a step (its launches and Python) sets, not its
    arithmetic: each model's rows below the first batch from which every step took at least ``GROWTH`` times the
    model's shortest step. That shortest step holds the whole fixed cost, so from there at least half of a step
    grows with the batch; below it, MFU would measure the launches (a toy model's steps get speed-ups instead)."""
    def below_growth(group: pd.DataFrame) -> pd.Series:
        steps = group.sort_values("batch_size")["median_s"]
        grown = (steps >= GROWTH * steps.min())[::-1].cummin()[::-1]  # grown here and at every larger batch
        return ~grown
    return pd.concat([below_growth(group) for _, group in curve.groupby("model", sort=False)]).reindex(curve.index)


def where_mfu_means_something(curve: pd.DataFrame) -> pd.DataFrame:
    """The sweep with ``launch_bound`` marked, and MFU and of achievable left out ("-") on those rows."""
    bound = launch_bound(curve)
    return curve.assign(launch_bound=bound, mfu=curve["mfu"].mask(bound),
                        of_achievable=curve["of_achievable"].mask(bound))


def percent(share: float) -> str:
    return "-" if math.isnan(share) else flops.percent(share)


def said(row) -> str:
    """A row's utilisation in a few words, beside the peak it divides by: "MFU 1.23 % of the dense tf32 peak (494.5
    TFLOP/s; 2.05 % of achievable)"; without a vendor peak, the share of the measured ceiling; "no MFU" where the step
    is launch-bound, "MFU not shown" where a figure was above 100 %."""
    if row.get("launch_bound", False):
        return "no MFU (launch-bound)"
    if row["mfu_warning"]:
        return "MFU not shown"
    if math.isnan(row["mfu"]):
        return f"{percent(row['of_achievable'])} of the measured {row['ceiling_precision']} ceiling"
    return (f"MFU {percent(row['mfu'])} of the dense {row['ceiling_precision']} peak ({row['datasheet_tflops']:g} "
            f"TFLOP/s; {percent(row['of_achievable'])} of achievable)")


def not_shown(rows: pd.DataFrame, what) -> None:
    """Say why each of ``rows`` shows no MFU (a figure above 100 % is no result); ``what(row)`` names the row. A
    sweep's launch-bound rows (``where_mfu_means_something``) get one line a model."""
    for _, row in rows[rows["mfu_warning"] != ""].iterrows():
        print(f"{what(row)}: MFU not shown: {row['mfu_warning']}.")
    bound = rows[rows["launch_bound"]] if "launch_bound" in rows else rows.iloc[:0]
    for name, group in bound.groupby("model", sort=False):
        shortest = rows.loc[rows["model"] == name, "median_s"].min()
        print(f"{name}: no MFU up to batch {group['batch_size'].max():,}: launch-bound there (MFU is shown from the "
              f"batch whose step, and every larger one's, takes {GROWTH:g}× its shortest, {shortest * 1e3:.3g} ms). "
              "The fixed cost of a step (its launches and Python) sets that time, not the arithmetic, so MFU would "
              "measure the launches: compare those batches by samples/s.")


def per_sample(c: Comparison, baseline_samples: int, candidate_samples: int) -> Comparison:
    """A comparison of two steps of different batch sizes, per sample: the candidate's samples/s over the baseline's
    (each pair's seconds divided by its samples), with its interval."""
    return Comparison.of([t / baseline_samples for t in c.baseline_times],
                         [t / candidate_samples for t in c.candidate_times],
                         labels=(c.baseline, c.candidate), caveats=c.caveats)


def sweep_table(curve: pd.DataFrame):
    """The sweep's samples/s, MFU, step time and tensors' peak by batch size and model."""
    table = curve.assign(step_ms=curve["median_s"] * 1e3).pivot(
        index="batch_size", columns="model", values=["samples_per_s", *SHARE_NAMES, "step_ms", "tensors_peak_MiB"])
    return table.rename(columns=SHARE_NAMES).style.format("{:,.1f}").format(percent, subset=list(SHARE_NAMES.values()))


def throughput_figure(curve: pd.DataFrame, knees: dict, ceilings: dict, device=None):
    """Samples/s, both models over one peak, step time and tensors' peak against the batch, each knee marked. One
    peak: the fastest precision's dense datasheet peak (``flops.reference_peak``; a CPU's measured ceiling), so that
    the higher point is the one doing more arithmetic a second."""
    peak_precision, peak_tflops = flops.reference_peak(sorted(ceilings), device)
    from_sheet = ceilings[peak_precision].datasheet_tflops == peak_tflops
    name = f"MFU against the dense {peak_precision} peak" if from_sheet else f"share of the measured {peak_precision} ceiling"
    curve = curve.assign(step_ms=curve["median_s"] * 1e3,  # no point where no share is shown (launch-bound, > 100 %)
                         one_peak=curve["achieved_tflops"].where(curve["of_achievable"].notna()) / peak_tflops)
    with plots.style():
        fig, axes = plt.subplots(2, 2, figsize=(13, 8.4))
    for ax, y, title, ylabel, log in ((axes[0, 0], "samples_per_s", "throughput", "samples/s", False),
                                      (axes[0, 1], "one_peak", f"both models on one scale: {peak_tflops:.4g} TFLOP/s",
                                       name, False),
                                      (axes[1, 0], "step_ms", "time per training step", "ms", True),
                                      (axes[1, 1], "tensors_peak_MiB", "peak memory of a step's tensors",
                                       "MiB on top of weights + momentum", True)):
        plots.curves(curve, "batch_size", y, by="model", ax=ax, logy=log, title=title, xlabel="batch size",
                     ylabel=ylabel)
    axes[0, 1].yaxis.set_major_formatter(PercentFormatter(1))
    axes[0, 1].set_ylim(bottom=0)
    colors = {line.get_label(): line.get_color() for line in axes[0, 0].get_lines()}
    for batch_size in sorted(set(knees.values())):
        names = [n for n, k in knees.items() if k == batch_size]
        plots.mark(axes[0, 0], batch_size, "knee", color=colors[names[0]] if len(names) == 1 else "tab:red")
    fig.suptitle(f"Full training steps on {device_info(device).name}")
    fig.tight_layout()
    return fig, axes


def reference_memory(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Each shipped row's peak memory of a step in MiB, and what it counted: ``tensors_peak_MiB``, the tensors as the
    lesson counts them; or, in rows recorded before the lesson counted tensors, ``peak_MiB``, the CUDA caching
    allocator's peak (which holds more than the tensors)."""
    missing = pd.Series(math.nan, index=rows.index)
    tensors = rows.get("tensors_peak_MiB", missing)
    counted = tensors.notna().map({True: "tensors", False: "allocator's peak"})
    return tensors.fillna(rows.get("peak_MiB", missing)), counted


def reference_figure(rows: pd.DataFrame, name: str = "03_throughput"):
    """The shipped rows of the sweep on real GPUs, their throughput and their memory as each counted it; the axes
    (None where none ship)."""
    if rows.empty:
        print(f"No reference results from real GPUs ship with the course for '{name}' yet: a full run of this "
              f"notebook on a GPU records them in results/{name}.csv (`gpulab reference add` ships them).")
        return None
    print("Reference results:", reference_provenance(name))
    step_mib, counted = reference_memory(rows)
    run = rows["device_name"] + " · " + rows["model"]
    rows = rows.assign(run=run, step_MiB=step_mib, counted_run=run + " (" + counted + ")")
    with plots.style():
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    plots.curves(rows, "batch_size", "samples_per_s", by="run", ax=axes[0], xlabel="batch size", ylabel="samples/s",
                 title="Reference: throughput of full training steps on real GPUs")
    plots.curves(rows.dropna(subset=["step_MiB"]), "batch_size", "step_MiB", by="counted_run", ax=axes[1],
                 xlabel="batch size", ylabel="MiB", title="Reference: peak memory of a step, as each run counted it")
    fig.tight_layout()
    if (counted != "tensors").any():
        print("Rows marked \"allocator's peak\" were recorded before the lesson counted tensors: the caching "
              "allocator's peak holds more than the tensors (section 3), so compare them with each other, not with "
              "this run's curve of tensors.")
    return axes


def trials_figure(search, budget: float | None):
    """Every trial of a ``find_max_batch`` search by batch size: its peak, the budget, the largest batch that fits."""
    trials = search.table()
    with plots.style():
        fig, ax = plt.subplots(figsize=(7, 4))
        for outcome, rows in trials.groupby("outcome"):
            ax.scatter(rows["batch_size"], rows["peak_MiB"], label=outcome, zorder=3)
        ax.set_xscale("log")
        ax.set_ylim(0, trials["peak_MiB"].max() * 1.3)  # room for the labels above the points
        ax.set(xlabel="batch size", ylabel="peak MiB of the trial", title="What find_max_batch tried")
        ax.legend()
    if budget:
        plots.hline(ax, budget / 2**20, f"budget: {budget / 2**20:.0f} MiB")
    if search.batch_size:
        plots.mark(ax, search.batch_size, f"largest that fits: {search.batch_size}", color="tab:green")
    return ax


def workspace_figure(beyond: pd.DataFrame, budget: float | None, device=None):
    """Each batch's peak counted two ways: its tensors, and the caching allocator's blocks."""
    with plots.style():
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(beyond.index, beyond["tensors_MiB"], marker="o", label="its tensors (MemoryTracker)")
        ax.plot(beyond.index, beyond["allocator_MiB"], marker="v", label="the allocator (max_memory_allocated)")
        ax.set_xscale("log")
        ax.set(xlabel="batch size", ylabel="peak MiB of a trial", ylim=(0, None),
               title=f"A SmallCNN training step on {device_info(device).name}, counted two ways")
        ax.legend()
    if budget:
        plots.hline(ax, budget / 2**20, f"budget: {budget / 2**20:.0f} MiB")
    return ax


def accumulation_figure(accumulation: pd.DataFrame, cost: Comparison, effective: int):
    """Samples/s and the tensors' peak of one optimizer step against the number of micro-batches, and the speed of
    the most micro-batches against one batch (interleaved pairs)."""
    with plots.style():
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), width_ratios=(1, 1, 1.2))
    for ax, y, ylabel, title in ((axes[0], "samples_per_s", "samples/s", f"throughput, effective batch {effective}"),
                                 (axes[1], "tensors_peak_MiB", "MiB", "peak memory of an optimizer step's tensors")):
        plots.curves(accumulation, "k", y, ax=ax, logy=False, xlabel="accumulation steps k", ylabel=ylabel,
                     title=title)
        ax.set_xticks(accumulation["k"], accumulation["k"])
        ax.set_ylim(bottom=0)
    most = accumulation["k"].iloc[-1]
    plots.speedups({f"k={most} against k=1": cost}, ax=axes[2], title="an optimizer step (interleaved pairs)")
    fig.tight_layout()
    return axes


def convergence_figure(convergence: pd.DataFrame):
    """The test loss of each run against its training seconds and against the samples it saw."""
    with plots.style():
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    plots.curves(convergence, "seconds", "test_loss", by="run", ax=axes[0], logx=False, xlabel="training seconds",
                 ylabel="test loss", title="loss reached per second")
    plots.curves(convergence, "samples", "test_loss", by="run", ax=axes[1], xlabel="training samples seen",
                 ylabel="test loss", title="loss reached per sample")
    axes[1].set_xscale("log")  # powers of ten: the sample counts span a wide range
    axes[0].get_legend().remove()
    axes[1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return axes


def final_table(final: pd.DataFrame):
    """Each run's last point: its batch, learning rate, updates, samples/s and test loss."""
    return final[["batch_size", "lr", "steps", "samples_per_s", "test_loss"]].style.format(
        {"lr": "{:.3g}", "steps": "{:,}", "samples_per_s": "{:,.0f}", "test_loss": "{:.3f}"})
