"""What the course's sources claimed, and what the shipped reference results measured: `gpulab claims`.

Every figure is computed from ``gpulab/reference/`` when the command runs; a claim whose experiment has no
shipped rows yet says which lesson measures it and how to record them (`gpulab reference record`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from .results import reference

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


def _activations(ref: pd.DataFrame) -> tuple[str, str]:
    ms = ref.groupby("activation")["step_ms"].median()
    ratios = {name: ms[name] / ms["ReLU"] for name in ("GELU", "SiLU")}
    figure = "step time vs ReLU: " + ", ".join(f"{name} {ratio:.2f}×" for name, ratio in ratios.items())
    if all(r < 0.95 for r in ratios.values()):
        return figure, "confirmed"
    return figure, "no difference within 5 %" if all(abs(r - 1) <= 0.05 for r in ratios.values()) else "not confirmed"


def _compile(ref: pd.DataFrame) -> tuple[str, str] | None:
    ms = ref.groupby("way")["step_ms"].median()
    if "torch.compile" not in ms:
        return None
    speedup = ms["eager"] / ms["torch.compile"]
    figure = f"torch.compile: {speedup:.2f}× eager's speed on a launch-bound step"
    return figure, ("torch.compile confirmed" if speedup > 1.05 else "torch.compile: no gain here") + \
        "; TorchScript not measured (deprecated)"


def _half_memory(ref: pd.DataFrame) -> tuple[str, str] | None:
    peak = ref.groupby("remedy")["peak_MiB"].median()
    autocast = [name for name in peak.index if name.startswith("autocast")]
    if not autocast or "baseline (Adam)" not in peak:
        return None
    ratio = peak[autocast[0]] / peak["baseline (Adam)"]
    figure = f"{autocast[0]}: peak memory of a training step {ratio:.2f}× fp32's"
    return figure, "confirmed" if ratio <= 0.55 else "not confirmed: weights, gradients and Adam's state stay fp32"


def _checkpointing(ref: pd.DataFrame) -> tuple[str, str]:
    by_config = ref.groupby("config")[["peak_MiB", "step_ms"]].median()
    base = by_config.loc["no checkpointing"]
    best = by_config.drop("no checkpointing").sort_values("peak_MiB").iloc[0]
    memory, time = best["peak_MiB"] / base["peak_MiB"], best["step_ms"] / base["step_ms"]
    figure = f"{best.name}: peak {memory:.2f}×, step time {time:.2f}× no checkpointing"
    return figure, "confirmed" if memory < 0.95 and time > 1 else "not confirmed"


def _cudnn_benchmark(ref: pd.DataFrame) -> tuple[str, str]:
    ms = ref.groupby("label")["step_ms"].median()
    fixed = ms["fixed shape, benchmark=True"] / ms["fixed shape, benchmark=False"]
    varying = ms["varying shapes, benchmark=True"] / ms["varying shapes, benchmark=False"]
    figure = f"step time with benchmark=True: {fixed:.2f}× for a fixed shape, {varying:.2f}× for varying shapes"
    if fixed < 0.95:
        return figure, "confirmed for fixed shapes" + ("; costs time when shapes vary" if varying > 1.05 else "")
    return figure, "not confirmed"


def _capstone(ref: pd.DataFrame) -> tuple[str, str]:
    kept = ref[ref["kept"].astype(str) == "True"]
    final, baseline = kept.iloc[-1], kept.iloc[0]
    speedup = final["vs_baseline"]
    figure = (f"the capstone's kept steps: {speedup:.2f}× the naive baseline's samples/s, accuracy "
              f"{final['accuracy']:.1%} vs {baseline['accuracy']:.1%}")
    if speedup >= 1.3:
        return figure, "confirmed, and larger than claimed" if speedup > 1.5 else "confirmed"
    return figure, "not confirmed"


def _ddp_over_dp(ref: pd.DataFrame) -> tuple[str, str]:
    rate = ref.groupby("method")["samples_per_s"].median()
    ratio = rate["DDP"] / rate["DataParallel"]
    gpus = int(ref["gpus"].max())
    figure = f"DDP trained {ratio:.2f}× the samples/s of DataParallel on {gpus} GPUs"
    if ratio > 1.05:
        return figure, "confirmed"
    return figure, "no difference within 5 %" if ratio >= 0.95 else "not confirmed"


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
