"""Lesson 05's tables, fits, figures and sentences: what its cells measured, recorded and said.

The lesson's cells do the measuring in plain PyTorch (the CUDA allocator's statistics, ``checkpoint``,
``empty_cache``, ``set_to_none``, the snapshot API, the fragmentation script). This module only logs what they
measured (``gpulab.ResultLog``), fits lines to it, draws it and words the verdicts, so that the cells show the
technique and not the harness."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import plots
from .results import ResultLog, reference_for

MiB = 2**20

# ----- section 1: a step, part by part --------------------------------------------------------------------------


def breakdown(predicted: dict, measured: dict, phases: dict, **sizes) -> pd.DataFrame:
    """Each optimizer's first step, part by part: predicted and measured MiB and their ratio. Every phase and part is
    logged (05_step_phases, 05_breakdown) with ``sizes``."""
    phase_log, part_log, rows = ResultLog("05_step_phases"), ResultLog("05_breakdown"), []
    for name, frame in phases.items():
        for row in frame.itertuples():
            phase_log.add(optimizer=name, phase=row.phase, allocated_MiB=row.allocated / MiB, peak_MiB=row.peak / MiB,
                          **sizes)
        rows += [part_log.add(optimizer=name, part=part, predicted_MiB=nbytes / MiB,
                              measured_MiB=measured[name][part] / MiB, **sizes)
                 for part, nbytes in predicted[name].items()]
    frame = pd.DataFrame(rows)
    frame["measured / predicted"] = frame["measured_MiB"] / frame["predicted_MiB"]
    return frame


def step_figure(frame: pd.DataFrame, phases: pd.DataFrame, *, title: str, name: str = "Adam") -> None:
    """Predicted against measured parts of every optimizer's step, beside ``name``'s memory over its phases."""
    parts = list(dict.fromkeys(frame["part"]))
    bars = pd.concat([frame.pivot(index="optimizer", columns="part", values=f"{source}_MiB")[parts]
                      .assign(source=source) for source in ("predicted", "measured")]).reset_index()
    with plots.style():
        fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    plots.predicted_vs_measured(bars, parts, label="optimizer", unit="MiB", ax=left, title=title)
    with plots.style():
        right.plot(phases["phase"], phases["allocated"] / MiB, marker="o", label="allocated after the phase")
        right.plot(phases["phase"], phases["peak"] / MiB, marker="v", linestyle=":", label="peak within the phase")
        right.set(ylabel="MiB", title=f"{name}: memory over the phases of a step", ylim=(0, None))
        right.tick_params(axis="x", rotation=30)
        right.legend()
    fig.tight_layout()
    plt.show()
    for optimizer, got in frame.groupby("optimizer", sort=False):
        measured, predicted = got["measured_MiB"].sum(), got["predicted_MiB"].sum()
        print(f"{optimizer:>16}: measured {measured:7.1f} MiB, predicted {predicted:7.1f} MiB "
              f"({measured / predicted:.3f}×); largest part: {got.set_index('part')['measured_MiB'].idxmax()}")


# ----- section 2: allocated against reserved ----------------------------------------------------------------------


def allocator_figure(states: list[dict]) -> pd.DataFrame:
    """The allocator's three counters after each action (rows of ``after``, ``allocated_MiB``, ``reserved_MiB``,
    ``device_used_MiB``), drawn; returned as a table."""
    frame = pd.DataFrame(states)[["after", "allocated_MiB", "reserved_MiB", "device_used_MiB"]]
    with plots.style():
        _, ax = plt.subplots(figsize=(9, 4))
        for column in ("allocated_MiB", "reserved_MiB", "device_used_MiB"):
            ax.plot(frame["after"], frame[column], marker="o", label=column.removesuffix("_MiB").replace("_", " "))
        ax.set(ylabel="MiB", title="The caching allocator keeps freed blocks until empty_cache()")
        ax.tick_params(axis="x", rotation=20)
        ax.legend()
    plt.show()
    return frame


# ----- section 3: activations against the batch -------------------------------------------------------------------


def activation_fits(activations: pd.DataFrame, *, title: str) -> dict:
    """A straight line through each model's activation bytes against the batch: {model: (bytes per sample, bytes
    whatever the batch)}; drawn with the measured points and the shipped reference rows, and printed."""
    fits = {name: np.polyfit(g["batch_size"], g["activation_MiB"] * MiB, 1)
            for name, g in activations.groupby("model", sort=False)}
    ax = plots.curves(activations, "batch_size", "activation_MiB", by="model", logx=False, logy=False,
                      xlabel="batch size", ylabel="MiB saved by the forward pass", title=title)
    for (slope, intercept), line in zip(fits.values(), ax.get_lines()):
        xs = np.array([0, activations["batch_size"].max()])
        ax.plot(xs, (slope * xs + intercept) / MiB, linestyle=":", color=line.get_color())
    plots.overlay_reference(ax, reference_for("05_activations"), "batch_size", "activation_MiB", by="model")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    plt.show()
    for name, (slope, intercept) in fits.items():
        print(f"{name:>22}: {slope / 1024:8.1f} KiB per sample (+ {intercept / 1024:.0f} KiB whatever the batch)")
    return fits


# ----- section 4: checkpointing -------------------------------------------------------------------------------------


def checkpointing_figure(peaks: dict, comparisons: dict, *, title: str) -> str:
    """Each configuration's peak beside its speed against no checkpointing, drawn and printed with the shipped
    reference rows; the configuration with the lowest peak."""
    with plots.style():
        fig, (left, right) = plt.subplots(1, 2, figsize=(14, 3.6))
    plots.bars({config: nbytes / MiB for config, nbytes in peaks.items()}, unit="MiB", ax=left,
               title="Peak of a step (above weights and Adam state)")
    plots.speedups(comparisons, ax=right, title="Speed of a step against no checkpointing")
    fig.suptitle(title)
    _fitted(fig)
    base = peaks["no checkpointing"]
    for config, comparison in comparisons.items():
        print(f"{config:>4}: peak {1 - peaks[config] / base:6.1%} lower; time: {comparison}")
    best = min(comparisons, key=peaks.get)
    print(f"Lowest peak at {best}: {peaks[best] / MiB:.1f} MiB instead of {base / MiB:.1f} MiB. Textbook time cost: one "
          "more forward, about 0.75× the speed (+33 % time per step); below, what that assumes.")
    reference = reference_for("05_checkpointing")
    if not reference.empty:
        from IPython.display import display

        display(reference.pivot_table(index="config", columns="device_name", values=["peak_MiB", "speedup"]).round(2))
    return best


def checkpointing_cost(recomputed, comparisons: dict, segments, *, depth: int) -> pd.DataFrame:
    """Checkpointing's measured cost beside the textbook's and beside one more forward of the blocks at its measured
    share of a step (``recomputed``: a whole step against the blocks' forward), with what tells them apart said from
    the intervals; ``segments``: one segment against ``depth``. A table of speeds with their intervals."""
    share = 1 / recomputed.speedup
    share_low, share_high = (1 / r for r in reversed(recomputed.interval))
    predicted, predicted_low, predicted_high = 1 / (1 + share), 1 / (1 + share_high), 1 / (1 + share_low)
    one_segment, per_block = comparisons[f"k={depth}"], comparisons["k=1"]
    cost = pd.DataFrame({
        "textbook: one more forward (1/3 of a step)": (0.75, np.nan, np.nan),
        "one more forward, its measured share": (predicted, predicted_low, predicted_high),
        f"measured: 1 segment (k={depth})": (one_segment.speedup, *one_segment.interval),
        f"measured: {depth} segments (k=1)": (per_block.speedup, *per_block.interval),
    }, index=["speed", "low", "high"]).T
    third = "more than" if share_low > 1 / 3 else "less than" if share_high < 1 / 3 else "about"
    print(f"The forward of the {depth} checkpointed blocks took {share:.2f} of a whole step here ({share_low:.2f}–"
          f"{share_high:.2f}, {recomputed.pairs} interleaved pairs): {third} the third the textbook assumes. One more "
          f"forward of them predicts {predicted:.2f}× the speed.")
    low, high = one_segment.interval
    if high < predicted_low:
        said = "slower than that: the rest is checkpointing's bookkeeping (the hooks on every saved tensor, the call)"
    elif low > predicted_high:
        said = "faster than that: the recomputation cost less than the forward timed on its own"
    else:
        said = f"within what one more forward predicts ({predicted_low:.2f}–{predicted_high:.2f}×)"
    print(f"One segment, the same recomputation in one checkpoint call, ran at {one_segment.speedup:.2f}× "
          f"({low:.2f}–{high:.2f}×): {said}.")
    if segments.verdict == "slower":
        per_call = (1 / segments.speedup - 1) / (depth - 1)
        print(f"{depth} segments instead of 1 recompute the same blocks, yet ran at {segments.speedup:.2f}× the speed "
              f"({segments.pairs} interleaved pairs): each further checkpoint call cost about {per_call:.0%} of a "
              "one-segment step. That is why the shortest segments, the lowest peak, cost the most time.")
    elif segments.verdict == "within noise":
        print(f"{depth} segments instead of 1 recompute the same blocks: {segments}. This machine could not tell them "
              "apart: whatever the calls' bookkeeping costs, it is within the noise of this step.")
    else:
        print(f"{depth} segments instead of 1 recompute the same blocks: {segments}. Here the shorter segments were "
              "faster, despite their extra calls.")
    return cost


# ----- section 5: the leak ------------------------------------------------------------------------------------------


def leak_growth(leak: pd.DataFrame, *, steps: int) -> dict:
    """Each loop's bytes alive after every step, drawn; its growth per step (a line through all steps but the first,
    which allocates what every step reuses), printed and returned by loop."""
    plots.curves(leak, "step", "alive_MiB", by="loop", logx=False, logy=False, xlabel="training step",
                 ylabel="MiB alive after the step", title="Memory over the steps of three loops")
    plt.show()
    growth = {name: np.polyfit(g["step"][1:], g["alive_MiB"][1:] * MiB, 1)[0]
              for name, g in leak.groupby("loop", sort=False)}
    for name, per_step in growth.items():
        print(f"{name:>24}: {per_step:12,.0f} bytes more per step")
    kept = growth["keeps_validation_losses"]
    print(f"The validation losses kept {kept / MiB:.2f} MiB per step: after {steps} steps, {kept * steps / MiB:.0f} MiB, "
          "and an OOM in a long run.")
    return growth


def timeline(events: pd.DataFrame, *, title: str) -> None:
    """Bytes alive (and reserved, from a snapshot) after each allocation event, drawn."""
    plots.memory_timeline(events, title=title)
    plt.show()


# ----- which remedy -------------------------------------------------------------------------------------------------

REMEDIES = {
    "activations": ["a smaller micro-batch with gradient accumulation (lesson 03): same effective batch",
                    "mixed precision (lesson 04): activations in 2 bytes",
                    "activation checkpointing (section 4): its blocks' forward run again in the backward (what "
                    "that costs depends on the model: section 4 measures it)"],
    "optimizer state": ["an optimizer with less state (SGD with momentum keeps half of Adam's)",
                        "shard the state across GPUs (ZeRO / FSDP, lesson 07), or offload it to the CPU",
                        "not the state itself but the peak at step(): fused=True or foreach=False (section 9) add no "
                        "temporaries the size of the model beside it"],
    "gradients": ["zero_grad(set_to_none=True): no gradients between steps",
                  "shard the gradients across GPUs (FSDP, lesson 07)"],
    "parameters": ["train in bf16 with fp32 master weights only where needed, or a smaller model",
                   "shard the parameters across GPUs (FSDP, lesson 07), or offload them to the CPU"],
    "batch": ["a smaller micro-batch with gradient accumulation (lesson 03)",
              "keep the data set on the host and copy each batch (lesson 02)"],
}


def advise(parts: pd.Series, what: str) -> str:
    """The parts of a measured step (MiB by part), largest first, and the remedies of the largest, cheapest first;
    the largest part."""
    total = parts.sum()
    print(f"{what}, {total:.1f} MiB in all:")
    for part, mib in parts.sort_values(ascending=False).items():
        print(f"  {part:>16}: {mib:8.1f} MiB ({mib / total:5.1%})")
    top = parts.idxmax()
    print(f"\nIt is dominated by the {top}. Try, in this order:")
    for remedy in REMEDIES[top]:
        print(f"  - {remedy}")
    return top


# ----- section 8: fragmentation -------------------------------------------------------------------------------------


def fragmentation(runs: list[dict], budget: int, log: ResultLog) -> pd.DataFrame:
    """The fragmentation script's runs (its JSON lines), logged, drawn (what each allocator held before and after the
    64 MiB request) and said; the logged rows."""
    rows = []
    for run in runs:
        before, after = run["before"], run["after"]
        rows.append(log.add(budget_MiB=budget / MiB, **{k: v for k, v in run.items() if k not in ("before", "after")},
                            allocated_before_MiB=before["allocated"] / MiB, reserved_before_MiB=before["reserved"] / MiB,
                            allocated_after_MiB=after["allocated"] / MiB, reserved_after_MiB=after["reserved"] / MiB,
                            alloc_retries=after["retries"] - before["retries"]))
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    moments = pd.DataFrame([
        {"bar": f"{row.allocator}, {when}", "allocated": getattr(row, f"allocated_{moment}_MiB"),
         "free in the cache": getattr(row, f"reserved_{moment}_MiB") - getattr(row, f"allocated_{moment}_MiB")}
        for row in frame.itertuples() for moment, when in (("before", "before the request"), ("after", "after it"))])
    with plots.style():
        _, ax = plt.subplots(figsize=(9, 1 + 0.6 * len(moments)))
        ax.barh(moments["bar"], moments["allocated"], label="allocated")
        ax.barh(moments["bar"], moments["free in the cache"], left=moments["allocated"], label="free in the cache")
        ax.axvline(budget / MiB, color="0.3", linestyle="--", linewidth=1, label="budget")
        ax.invert_yaxis()
        ax.set(xlabel="MiB", title=f"Every other 20 MiB tensor freed, then a 64 MiB request, within {budget // MiB} MiB")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    plt.show()
    for row in frame.itertuples():
        print(f"{row.allocator:>20}: {row.kept} tensors of 20 MiB kept, "
              f"{row.reserved_before_MiB - row.allocated_before_MiB:,.0f} MiB free in the cache; the 64 MiB tensor "
              f"{'fits' if row.large_fits else 'does NOT fit (out of memory)'} after {row.alloc_retries} "
              f"retr{'y' if row.alloc_retries == 1 else 'ies'}; then {row.allocated_after_MiB:,.0f} MiB allocated, "
              f"{row.reserved_after_MiB:,.0f} MiB reserved.")
    return frame


# ----- section 9: the remedies --------------------------------------------------------------------------------------


def remedies_figure(remedies: pd.DataFrame, comparisons: dict, *, baseline: str, title: str) -> None:
    """Each remedy's peak and optimizer temporaries as multiples of the baseline's, beside its speed, drawn and
    printed."""
    with plots.style():
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8.5), gridspec_kw={"height_ratios": [1.2, 1]})
    plots.relative_bars(remedies, {"peak_MiB": "peak memory of a step (MiB)",
                                   "update_MiB": "optimizer.step()'s temporaries (MiB)"},
                        label="remedy", baseline=baseline, ax=top, title=title)
    plots.speedups(comparisons, ax=bottom, title="Speed of a step against the baseline")
    _fitted(fig)
    base = remedies.iloc[0]
    for row in remedies.iloc[1:].itertuples():
        print(f"{row.remedy:>20}: peak {row.peak_MiB / base.peak_MiB:4.2f}× the baseline's, optimizer.step() "
              f"temporaries {row.update_MiB:.2f} MiB\n{'':>22}time: {comparisons[row.remedy]}")


def _fitted(fig) -> None:
    """Lay the figure out, widen each axis's scale until its value labels fit again, and show it."""
    fig.tight_layout()
    for ax in fig.axes:
        plots.fit_labels(ax, ax.texts)
    plt.show()
