"""What the course's sources claimed, and what the shipped reference results measured: `gpulab claims`.

Every figure is computed from ``gpulab/reference/`` when the command runs; a claim whose experiment has no
shipped rows yet says which lesson measures it and how to record them (`gpulab reference record`).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from ..results import reference

NOT_YET = "not measured on a GPU yet"


@dataclass(frozen=True)
class Claim:
    """A claim of a source, the lesson and reference results that measure it, and how to read them."""

    source: str
    text: str
    lesson: str
    reference: str
    judge: Callable[[pd.DataFrame], tuple[str, str] | None] | None = None  # rows → (figure, verdict), None: no figure


def _sync_in_a_loop(ref: pd.DataFrame) -> tuple[str, str]:
    per_step = ref.pivot_table(index="width", columns="label", values="ms_per_step")
    slowdown = per_step["train_sync_every_step"] / per_step["train_transfer_once"]
    figure = (f"a sync each step: {slowdown.min():.2f}× to {slowdown.max():.2f}× the time per step "
              f"over model widths {slowdown.index.min()}–{slowdown.index.max()}")
    if slowdown.min() > 1.5:
        return figure, "confirmed"
    return figure, "depends on the work per step" if slowdown.max() > 1.5 else "not confirmed"


def _pinned_memory(ref: pd.DataFrame) -> tuple[str, str]:
    h2d = ref[ref["direction"] == "H2D"].pivot_table(index="nbytes", columns="memory", values="gbps")
    gain = h2d["pinned"] / h2d["pageable"] - 1
    largest = h2d.index.max()
    figure = (f"host→device, pinned vs pageable: {gain.min():+.0%} to {gain.max():+.0%} over "
              f"{_bytes(h2d.index.min())}–{_bytes(largest)} ({gain[largest]:+.0%} at {_bytes(largest)})")
    if gain.min() >= 0.4:
        return figure, "confirmed, and larger than claimed"
    return figure, "depends on the copy's size" if gain.max() >= 0.4 else "not confirmed"


def _compared(row) -> str:
    """A recorded comparison in words: its median speed-up, interval and verdict."""
    return f"{row['speedup']:.2f}× ({row['speedup_low']:.2f}–{row['speedup_high']:.2f}×, {row['verdict']})"


def _activations(ref: pd.DataFrame) -> tuple[str, str] | None:
    rows = ref[ref["activation"].isin(["GELU", "SiLU"])].drop_duplicates("activation", keep="last")
    if len(rows) < 2 or "verdict" not in rows:
        return None
    figure = "speed vs ReLU: " + ", ".join(f"{r.activation} {_compared(r._asdict())}" for r in rows.itertuples())
    verdicts = set(rows["verdict"])
    if verdicts == {"faster"}:
        return figure, "confirmed"
    return figure, "not confirmed" if "slower" in verdicts else "within noise: not supported"


def _compile(ref: pd.DataFrame) -> tuple[str, str] | None:
    rows = ref[ref["way"] == "torch.compile"]
    if rows.empty or "verdict" not in rows:
        return None
    row = rows.iloc[-1]
    figure = f"torch.compile vs eager on a launch-bound step: {_compared(row)}"
    said = {"faster": "torch.compile confirmed", "slower": "torch.compile: slower here"}.get(
        row["verdict"], "torch.compile: within noise")
    return figure, said + "; TorchScript not measured (deprecated)"


def _half_memory(ref: pd.DataFrame) -> tuple[str, str] | None:
    peak = ref.groupby("remedy")["peak_MiB"].median()
    autocast = [name for name in peak.index if name.startswith("autocast")]
    if not autocast or "baseline (Adam)" not in peak:
        return None
    ratio = peak[autocast[0]] / peak["baseline (Adam)"]
    figure = f"{autocast[0]}: peak memory of a training step {ratio:.2f}× fp32's"
    return figure, "confirmed" if ratio <= 0.55 else "not confirmed: weights, gradients and Adam's state stay fp32"


def _checkpointing(ref: pd.DataFrame) -> tuple[str, str] | None:
    rows = ref[ref["config"] != "no checkpointing"]
    if rows.empty or "verdict" not in rows:
        return None
    best = rows.assign(memory=rows["peak_MiB"] / rows["baseline_peak_MiB"]).sort_values("memory").iloc[0]
    figure = f"{best['config']}: peak {best['memory']:.2f}× no checkpointing's, speed {_compared(best)}"
    if best["memory"] >= 0.95:
        return figure, "not confirmed"
    return figure, {"slower": "confirmed", "within noise": "saves memory; its compute cost is within noise"}.get(
        best["verdict"], "saves memory, at no cost measured here")


def _cudnn_benchmark(ref: pd.DataFrame) -> tuple[str, str] | None:
    steady = ref[ref["label"] == "steady state, one shape"]
    first = ref[ref["label"] == "first step at a new shape (autotuning included)"]
    if steady.empty or first.empty:
        return None
    steady, first = steady.iloc[-1], first.iloc[-1]
    figure = f"benchmark=True, steady state: {_compared(steady)}; first step at a new shape: {_compared(first)}"
    if steady["verdict"] != "faster":
        return figure, "not confirmed" if steady["verdict"] == "slower" else "within noise: not supported"
    return figure, "confirmed for fixed shapes" + ("; costs time when shapes change" if first["verdict"] == "slower"
                                                   else "")


def _capstone(ref: pd.DataFrame) -> tuple[str, str] | None:
    """Lesson 08's final race: the optimised job against the naive one, side by side (with the time each took to the
    target accuracy, where the row has it)."""
    rows = ref[ref["step"] == "optimised vs naive"]
    if rows.empty:
        return None
    row = rows.iloc[-1]
    figure = f"the optimised capstone job vs the naive one, side by side: {_compared(row)}, accuracy " \
             f"{row['accuracy']:.1%}"
    if pd.notna(row.get("time_to_target_s")) and pd.notna(row.get("time_to_target_naive_s")):
        figure += f", {row['time_to_target_naive_s']:.3g} s → {row['time_to_target_s']:.3g} s to the target accuracy"
    if row["verdict"] != "faster" or row["speedup_low"] < 1.3:
        return figure, "not confirmed" if row["speedup_high"] < 1.3 else "within noise of the claim"
    return figure, "confirmed, and larger than claimed" if row["speedup_low"] > 1.5 else "confirmed"


def _ddp_over_dp(ref: pd.DataFrame) -> tuple[str, str] | None:
    if "verdict" not in ref:
        return None
    row = ref.iloc[-1]
    figure = f"DDP vs DataParallel on {int(row['gpus'])} GPUs: {_compared(row)}"
    return figure, {"faster": "confirmed", "slower": "not confirmed"}.get(row["verdict"], "within noise: not supported")


def _mixed_precision(ref: pd.DataFrame) -> tuple[str, str] | None:
    """Lesson 10's waterfall: the TF32 and autocast steps, each raced against the configuration before it."""
    rows = ref[(ref["step"] == "TF32") | ref["step"].astype(str).str.startswith("autocast")]
    rows = rows.dropna(subset=["verdict"]).drop_duplicates("step", keep="last") if "verdict" in rows else rows.iloc[:0]
    if rows.empty:
        return None
    figure = "a GPT's training step vs the step before: " + ", ".join(
        f"{r.step} {r.vs_previous:.2f}× ({r.low:.2f}–{r.high:.2f}×, {r.verdict})" for r in rows.itertuples())
    verdicts = set(rows["verdict"])
    if verdicts == {"faster"}:
        return figure, "confirmed"
    return figure, "not confirmed" if "slower" in verdicts else "within noise: not supported"


def _flash_memory(ref: pd.DataFrame) -> tuple[str, str] | None:
    """Lesson 09's attention sweep: how the peak memory of a forward and backward grows between the two longest
    sequences each way ran, as the exponent of T."""
    ran = ref[ref["out_of_memory"].astype(str) != "True"].dropna(subset=["peak_MiB"])

    def growth(way: str) -> tuple[float, int] | None:
        peak = ran[ran["way"] == way].groupby("seq_len")["peak_MiB"].median().sort_index()
        if len(peak) < 2:
            return None
        (t0, m0), (t1, m1) = peak.iloc[-2:].items()
        return math.log(m1 / m0) / math.log(t1 / t0), int(t1)

    flash, written = growth("SDPA, flash forced"), growth("written out")
    if flash is None:
        return None
    figure = f"peak memory grows as T^{flash[0]:.2f} with flash attention (up to T = {flash[1]})"
    if written:
        figure += f", T^{written[0]:.2f} written out (up to T = {written[1]})"
    return figure, "confirmed" if flash[0] <= 1.25 else "not confirmed"


CLAIMS = [
    Claim("003", "`.cpu()` in a loop: 0.583 s vs 0.021 s (a sync each step)", "01", "01_sync_in_loop",
          _sync_in_a_loop),
    Claim("001", "`pin_memory` makes transfers about 40 % faster", "02", "02_transfer_bandwidth", _pinned_memory),
    Claim("001", "SiLU/GELU are more efficient for GPUs than ReLU", "06", "06_activations", _activations),
    Claim("003", "TorchScript speeds models up (TorchScript is deprecated: lesson 06 measures torch.compile)", "06",
          "06_launch_bound", _compile),
    Claim("000", "FP16 halves memory", "05", "05_remedies", _half_memory),
    Claim("001", "30–50 % faster from optimisation", "08", "08_capstone", _capstone),
    Claim("000, 002, 003", "gradient checkpointing saves memory at some compute cost", "05", "05_checkpointing",
          _checkpointing),
    Claim("001, 002", "`cudnn.benchmark` finds faster algorithms", "06", "06_cudnn_benchmark", _cudnn_benchmark),
    Claim("001, 003", "DDP is more efficient than DataParallel", "07", "07_dp_vs_ddp", _ddp_over_dp),
    Claim("000", "mixed precision and tensor cores speed training", "10", "10_waterfall", _mixed_precision),
    Claim("000", "FlashAttention's memory grows linearly with the sequence length, not quadratically", "09",
          "09_attention", _flash_memory),
]


def table(claims: list[Claim] = CLAIMS) -> pd.DataFrame:
    """One row per claim and GPU: source, claim, lesson, the measured figure on that GPU, and the verdict."""
    rows = []
    for claim in claims:
        ref = reference(claim.reference)
        if ref.empty:
            readings = [(f"`{claim.reference}`: run `gpulab reference record` on a GPU", NOT_YET)]
        else:
            readings = [_read(claim, gpu, gpu_rows) for gpu, gpu_rows in ref.groupby("device_name", sort=True)]
        for figure, verdict in readings:
            rows.append({"source": claim.source, "claim": claim.text, "lesson": claim.lesson,
                         "measured": figure, "verdict": verdict})
    return pd.DataFrame(rows)


def _read(claim: Claim, gpu: str, rows: pd.DataFrame) -> tuple[str, str]:
    """(figure on ``gpu``, verdict) from that GPU's reference rows."""
    judged = claim.judge(rows) if claim.judge else None
    if judged is None:
        return f"{gpu}: `{claim.reference}` holds no rows this claim can be read from", "not judged"
    figure, verdict = judged
    return f"{gpu}: {figure}", verdict


def markdown(frame: pd.DataFrame) -> str:
    """The table as a GitHub-flavoured Markdown table (as the README holds it)."""
    header = "| " + " | ".join(frame.columns) + " |"
    rule = "| " + " | ".join("---" for _ in frame.columns) + " |"
    body = ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body])


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
