"""The vendors' dense peak FLOP/s of the GPUs a learner meets, per precision: the denominator of MFU.

Model FLOPs utilisation, as PaLM, Megatron-LM, torchtitan and nanoGPT report it, divides the model's FLOP/s by the
vendor's **dense** datasheet peak of the precision the step ran in, so that one MFU can be compared with another
(a measured ceiling, "of achievable", goes beside it: ``gpulab.flops``). These are the vendors' figures, not
measurements: dense (a "with sparsity" figure is twice the dense one), at boost clock, tensor-core rates for tf32,
fp16, bf16 and fp8 (with fp32 accumulation where a card lists two), the CUDA-core rate for fp32. A precision a card
does not run natively (bf16 on a T4, fp8 before Ada) has no entry.

    >>> datasheets.peak("NVIDIA H100 80GB HBM3", "bf16")
    989.5
"""

import re
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Sheet:
    """One card's dense peaks in TFLOP/s per precision, and the document they come from."""

    name: str
    tflops: dict
    source: str


_HOPPER = "NVIDIA {} Tensor Core GPU datasheet"
_AMPERE = "NVIDIA A100 Tensor Core GPU datasheet (the same figures for 40 and 80 GB, SXM and PCIe)"
SHEETS = {sheet.name: sheet for sheet in (
    Sheet("T4", {"fp32": 8.1, "fp16": 65.0}, "NVIDIA T4 Tensor Core GPU datasheet (mixed-precision FP16/FP32)"),
    Sheet("L4", {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0, "fp8": 242.5}, "NVIDIA L4 datasheet"),
    Sheet("A10", {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0}, "NVIDIA A10 Tensor Core GPU datasheet"),
    Sheet("A10G", {"fp32": 35.0, "tf32": 35.0, "fp16": 70.0, "bf16": 70.0},
          "AWS's published figures for the A10G of its G5 instances (NVIDIA publishes no A10G datasheet)"),
    Sheet("L40S", {"fp32": 91.6, "tf32": 183.0, "fp16": 362.05, "bf16": 362.05, "fp8": 733.0}, "NVIDIA L40S datasheet"),
    Sheet("A100 SXM 40GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE),
    Sheet("A100 SXM 80GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE),
    Sheet("A100 PCIe 40GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE),
    Sheet("A100 PCIe 80GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE),
    Sheet("H100 SXM", {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1978.9}, _HOPPER.format("H100")),
    Sheet("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0, "fp8": 1513.0}, _HOPPER.format("H100")),
    Sheet("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5}, _HOPPER.format("H100")),
    Sheet("H200 SXM", {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1978.9}, _HOPPER.format("H200")),
    Sheet("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5}, _HOPPER.format("H200")),
    Sheet("B200", {"fp32": 75.0, "tf32": 1100.0, "fp16": 2250.0, "bf16": 2250.0, "fp8": 4500.0},
          "NVIDIA HGX B200 datasheet (per GPU, 1000 W)"),
    Sheet("RTX 4090", {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3},
          "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 (fp32 accumulate)"),
    Sheet("RTX 3090", {"fp32": 35.6, "tf32": 35.6, "fp16": 71.0, "bf16": 71.0},
          "NVIDIA Ampere GA102 architecture whitepaper, GeForce RTX 3090 (fp32 accumulate)"),
)}

# A device name's entry: the first whose words are all words of the name (torch's names: "Tesla T4", "NVIDIA A10G",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GeForce RTX
# 4090"). The most specific first.
_NAMES = (
    ("H100 PCIe", ("H100", "PCIE")), ("H100 NVL", ("H100", "NVL")), ("H100 SXM", ("H100",)),
    ("H200 NVL", ("H200", "NVL")), ("H200 SXM", ("H200",)), ("B200", ("B200",)),
    ("A100 PCIe 80GB", ("A100", "PCIE", "80GB")), ("A100 PCIe 40GB", ("A100", "PCIE")),
    ("A100 SXM 80GB", ("A100", "80GB")), ("A100 SXM 40GB", ("A100",)),
    ("A10G", ("A10G",)), ("A10", ("A10",)), ("L40S", ("L40S",)), ("L4", ("L4",)), ("T4", ("T4",)),
    ("RTX 4090", ("RTX", "4090")), ("RTX 3090", ("RTX", "3090")),
)


def find(device_name: str) -> Sheet | None:
    """The sheet of a device name such as 'NVIDIA H100 80GB HBM3' (None for CPUs and cards not listed)."""
    words = set(re.split(r"[^A-Z0-9]+", str(device_name).upper()))
    return next((SHEETS[entry] for entry, needed in _NAMES if words.issuperset(needed)), None)


def peak(device_name: str, precision: str) -> float | None:
    """The dense datasheet peak in TFLOP/s of a device and precision (None where not listed or not native)."""
    sheet = find(device_name)
    return sheet.tflops.get(precision) if sheet else None


def table() -> pd.DataFrame:
    """Every card's dense peaks, one row per card (TFLOP/s; empty where a precision is not native), and the source."""
    rows = [{"gpu": s.name, **{p: s.tflops.get(p) for p in ("fp32", "tf32", "fp16", "bf16", "fp8")}, "source": s.source}
            for s in SHEETS.values()]
    return pd.DataFrame(rows).set_index("gpu")
