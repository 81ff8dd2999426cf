"""The vendors' datasheets of the GPUs a learner meets: the dense peak FLOP/s per precision (the denominator of MFU)
and the facts a lesson's plan sizes its experiments from (memory, its bandwidth, the host link, the power limit).

Model FLOPs utilisation, as PaLM, Megatron-LM, torchtitan and nanoGPT report it, divides the model's FLOP/s by the
vendor's **dense** datasheet peak of the precision the step ran in, so that one MFU can be compared with another
(a measured ceiling, "of achievable", goes beside it: ``gpulab.flops``). These are the vendors' figures, not
measurements: dense (a "with sparsity" figure is twice the dense one), at boost clock, tensor-core rates for tf32,
fp16, bf16 and fp8 (with fp32 accumulation where a card lists two), the CUDA-core rate for fp32. A precision a card
does not run natively (bf16 on a T4, fp8 before Ada) has no entry. Memory is the capacity the vendor states (in
GiB, as vendors count it: CUDA reports a little less, the driver keeps some), bandwidth that of device memory, the host
link the card's PCIe generation and lanes, power the board's limit (a laptop's depends on the laptop: its maximum),
the L2 cache its size as CUDA reports it (the architecture whitepapers' figures; the H200's as torch read it on one).

    >>> datasheets.peak("NVIDIA H100 80GB HBM3", "bf16")
    989.5
"""

import math
import re
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Sheet:
    """One card's dense peaks in TFLOP/s per precision, its hardware facts, and the document they come from."""

    name: str
    tflops: dict
    source: str
    memory_gib: float = math.nan
    bandwidth_gbs: float = math.nan  # device memory, GB/s
    pcie: tuple[int, int] = (0, 0)  # the host link: PCIe generation, lanes
    power_w: float = math.nan
    compute_capability: tuple[int, int] = (0, 0)
    sms: int = 0
    l2_mib: float = math.nan  # the L2 cache in MiB, as CUDA reports it (torch's L2_cache_size / 2**20); NaN: not listed


_HOPPER = "NVIDIA {} Tensor Core GPU datasheet"
_AMPERE = "NVIDIA A100 Tensor Core GPU datasheet (the same figures for 40 and 80 GB, SXM and PCIe)"
SHEETS = {sheet.name: sheet for sheet in (
    Sheet("T4", {"fp32": 8.1, "fp16": 65.0}, "NVIDIA T4 Tensor Core GPU datasheet (mixed-precision FP16/FP32)",
          memory_gib=16, bandwidth_gbs=320, pcie=(3, 16), power_w=70, compute_capability=(7, 5), sms=40, l2_mib=4),
    Sheet("L4", {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0, "fp8": 242.5}, "NVIDIA L4 datasheet",
          memory_gib=24, bandwidth_gbs=300, pcie=(4, 16), power_w=72, compute_capability=(8, 9), sms=58, l2_mib=48),
    Sheet("A10", {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0}, "NVIDIA A10 Tensor Core GPU datasheet",
          memory_gib=24, bandwidth_gbs=600, pcie=(4, 16), power_w=150, compute_capability=(8, 6), sms=72, l2_mib=6),
    Sheet("A10G", {"fp32": 35.0, "tf32": 35.0, "fp16": 70.0, "bf16": 70.0},
          "AWS's published figures for the A10G of its G5 instances (NVIDIA publishes no A10G datasheet)",
          memory_gib=24, bandwidth_gbs=600, pcie=(4, 16), power_w=300, compute_capability=(8, 6), sms=80, l2_mib=6),
    Sheet("L40S", {"fp32": 91.6, "tf32": 183.0, "fp16": 362.05, "bf16": 362.05, "fp8": 733.0}, "NVIDIA L40S datasheet",
          memory_gib=48, bandwidth_gbs=864, pcie=(4, 16), power_w=350, compute_capability=(8, 9), sms=142),
    Sheet("A100 SXM 40GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE,
          memory_gib=40, bandwidth_gbs=1555, pcie=(4, 16), power_w=400, compute_capability=(8, 0), sms=108, l2_mib=40),
    Sheet("A100 SXM 80GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE,
          memory_gib=80, bandwidth_gbs=2039, pcie=(4, 16), power_w=400, compute_capability=(8, 0), sms=108, l2_mib=40),
    Sheet("A100 PCIe 40GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE,
          memory_gib=40, bandwidth_gbs=1555, pcie=(4, 16), power_w=250, compute_capability=(8, 0), sms=108, l2_mib=40),
    Sheet("A100 PCIe 80GB", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, _AMPERE,
          memory_gib=80, bandwidth_gbs=1935, pcie=(4, 16), power_w=300, compute_capability=(8, 0), sms=108, l2_mib=40),
    Sheet("H100 SXM", {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1978.9}, _HOPPER.format("H100"),
          memory_gib=80, bandwidth_gbs=3350, pcie=(5, 16), power_w=700, compute_capability=(9, 0), sms=132, l2_mib=50),
    Sheet("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0, "fp8": 1513.0}, _HOPPER.format("H100"),
          memory_gib=80, bandwidth_gbs=2000, pcie=(5, 16), power_w=350, compute_capability=(9, 0), sms=114, l2_mib=50),
    Sheet("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5}, _HOPPER.format("H100"),
          memory_gib=94, bandwidth_gbs=3900, pcie=(5, 16), power_w=400, compute_capability=(9, 0), sms=132, l2_mib=50),
    Sheet("H200 SXM", {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1978.9}, _HOPPER.format("H200"),
          memory_gib=141, bandwidth_gbs=4800, pcie=(5, 16), power_w=700, compute_capability=(9, 0), sms=132, l2_mib=60),
    Sheet("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5}, _HOPPER.format("H200"),
          memory_gib=141, bandwidth_gbs=4800, pcie=(5, 16), power_w=600, compute_capability=(9, 0), sms=132, l2_mib=60),
    Sheet("B200", {"fp32": 75.0, "tf32": 1100.0, "fp16": 2250.0, "bf16": 2250.0, "fp8": 4500.0},
          "NVIDIA HGX B200 datasheet (per GPU, 1000 W)",
          memory_gib=180, bandwidth_gbs=7700, pcie=(5, 16), power_w=1000, compute_capability=(10, 0), sms=148),
    Sheet("RTX 4090", {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3},
          "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 (fp32 accumulate)",
          memory_gib=24, bandwidth_gbs=1008, pcie=(4, 16), power_w=450, compute_capability=(8, 9), sms=128, l2_mib=72),
    # NVIDIA lists no tensor rates for laptop GPUs: the Ada whitepaper's per-SM rates of the RTX 4090 (512 dense fp16 FLOP
    # per clock per SM with fp32 accumulate, 256 fp32) times 24 SMs at the 4060 Laptop's highest boost clock, 2370 MHz
    # (its clock and power depend on the laptop: 35-115 W, more with Dynamic Boost)
    Sheet("RTX 4060 Laptop", {"fp32": 14.6, "tf32": 14.6, "fp16": 29.1, "bf16": 29.1, "fp8": 58.2},
          "NVIDIA Ada Lovelace architecture whitepaper's per-SM rates at the GeForce RTX 4060 Laptop GPU's 2370 MHz boost",
          memory_gib=8, bandwidth_gbs=256, pcie=(4, 8), power_w=115, compute_capability=(8, 9), sms=24, l2_mib=32),
    Sheet("RTX 3090", {"fp32": 35.6, "tf32": 35.6, "fp16": 71.0, "bf16": 71.0},
          "NVIDIA Ampere GA102 architecture whitepaper, GeForce RTX 3090 (fp32 accumulate)",
          memory_gib=24, bandwidth_gbs=936, pcie=(4, 16), power_w=350, compute_capability=(8, 6), sms=82, l2_mib=6),
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
    ("RTX 4090", ("RTX", "4090")), ("RTX 4060 Laptop", ("RTX", "4060", "LAPTOP")), ("RTX 3090", ("RTX", "3090")),
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
