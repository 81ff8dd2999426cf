"""The card a lesson is planned for: its datasheet (memory, rates, host link, power, architecture), the share of each
rate a real card reached, and the host's CPU cores.

A plan is a function of the card's name, so that ``gpulab plan --card "Tesla T4"`` on a laptop without a GPU prints
what a learner's T4 prints: the sizes come from the **datasheet** (``gpulab.datasheets``), never from a reading that
differs between two T4s, and a lesson checks the memory that is free when it runs against what its plan needs. A card
the datasheets do not list is planned from what CUDA reports of it (its architecture, and the features that follow
from it, its memory, SMs and L2) and rates guessed from a listed card's per SM (``unlisted_sheet``; its note says so).

**Achievable rates.** A datasheet's peak is not what a program reaches. Each rate a plan divides work by is the peak
times the share of it that an H100 80GB HBM3 reached in the course's own runs (``gpulab/reference/``, 2026-11-22:
``gpulab bench`` and lesson 04's peak search; fp8 from lesson 09's ceilings on an H200, 2026-11-27): read from the
shipped rows when this module is imported, not typed in. Smaller cards reach less of their peak (a T4 at its 70 W
limit, a laptop's GPU at its power budget): the minutes a plan gives them are optimistic, and the lessons' time limits
(``racing.Budget``) hold whatever the estimate.
"""

import functools
import os
from dataclasses import dataclass, field, replace

import pandas as pd
import torch

from .. import datasheets
from ..device import PCIE_LANE_GBPS, on_gpu
from ..results import reference

# The share of a PCIe link's theoretical bandwidth the GPU's DMA engines reach with pinned memory and of device
# memory's bandwidth a copy reaches, the seconds a tiny kernel's launch costs and one CPU core's fp32 matmul rate (lesson
# 00's CPU rows, 16 threads) are read from the same runs.
MEASURED_ON = "NVIDIA H100 80GB HBM3"
# The host a named card is planned with, where the card is not this machine's: Colab's free T4 runtime has 2 vCPUs;
# the H100 and H200 VMs the course was measured on had 16 cores; other cards: a workstation or a small cloud VM.
# ``gpulab plan --cpus`` changes it.
TYPICAL_CPUS = {"T4": 2, "H100 SXM": 16, "H200 SXM": 16}
DEFAULT_CPUS = 8
# Where a lesson runs on a CPU with GPULAB_QUICK=0 (full sizes on a CPU): the sizes the course was first measured at.
FULL_ON_CPU = "NVIDIA H100 80GB HBM3"
# The architectures from which a card runs bf16 and TF32 natively (with flash attention), FP8, and NVML's GPM.
AMPERE, FP8_FROM, HOPPER = (8, 0), (8, 9), (9, 0)
# What a card may lack that some lesson uses, and what its lack changes there.
FEATURES = {
    "bf16": "native bf16 (sm_80+): 16-bit runs in fp16 (training with a GradScaler)",
    "tf32": "TF32 tensor cores (sm_80+): fp32 matmuls have only the CUDA cores",
    "flash attention": "flash attention (sm_80+): SDPA runs its memory-efficient kernel",
    "fp8": "FP8 tensor cores (sm_89+): no FP8 matmul",
    "gpm": "GPM (Hopper+): NVML gives no SM occupancy or tensor activity; the profiler's trace says how busy the GPU was",
    "second gpu": "a second GPU: the multi-GPU runs are gloo processes on the CPU",
}


@functools.cache
def achievable() -> dict[str, float]:
    """The share of its datasheet that a real card reached, per rate: 'fp32' ... 'fp8' (matmuls), 'copy' (device
    memory), 'host' (pinned host-to-device copies over PCIe); and two rates that are not shares: 'launch_s' (seconds
    per tiny kernel) and 'cpu_core_tflops' (one CPU core's fp32 matmuls)."""
    sheet = datasheets.find(MEASURED_ON)
    peaks = reference("04_matmul_precision")
    peaks = peaks[(peaks["kind"] == "peak") & (peaks["device_name"] == MEASURED_ON)]
    shares = {p: peaks.loc[peaks["precision"] == p, "tflops"].max() / sheet.tflops[p] for p in ("fp32", "tf32", "fp16",
                                                                                                  "bf16")}
    fp8 = reference("09_ceilings").query("precision == 'fp8'").iloc[-1]
    shares["fp8"] = fp8["ceiling_tflops"] / datasheets.find(fp8["device_name"]).tflops["fp8"]
    bench = reference("bench").query("device_name == @MEASURED_ON").set_index("test")["value"]
    shares["copy"] = bench[_test(bench, "memory copy")] / sheet.bandwidth_gbs
    shares["host"] = bench[_test(bench, "host→device pinned")] / (PCIE_LANE_GBPS[sheet.pcie[0]] * sheet.pcie[1])
    shares["launch_s"] = bench[_test(bench, "launch of a tiny op")] * 1e-6
    cpu = reference("00_matmul").query("on == 'cpu' and device_name == @MEASURED_ON")
    shares["cpu_core_tflops"] = (cpu["tflops"] / cpu["threads"]).max()
    return shares


def _test(bench: pd.Series, prefix: str) -> str:
    return next(name for name in bench.index if name.startswith(prefix))


@dataclass(frozen=True)
class Card:
    """A GPU as its lesson plans see it (or the CPU, which runs quick mode): name, datasheet, the host's CPU cores and
    how many GPUs the machine has."""

    name: str
    sheet: datasheets.Sheet | None
    cpu_cores: int
    gpus: int = 1
    # GB (1e9 bytes) the plans size against; 0: the datasheet's capacity read as decimal GB, within a few per cent of
    # what CUDA reports (a T4's "16 GB" is 15.8 GB to CUDA, an L4's "24 GB" 23.6 GB, an H100's "80 GB" 85.0 GB, an
    # H200's "141 GB" 150.1 GB): the plans fill at most ``usable_gb`` of it
    memory_gb: float = field(default=0.0)
    note: str = ""  # where the facts come from, where not the datasheet

    def __post_init__(self):
        if not self.memory_gb and self.sheet is not None:
            object.__setattr__(self, "memory_gb", float(self.sheet.memory_gib))

    @classmethod
    def named(cls, name: str, *, cpus: int | None = None, gpus: int = 1) -> "Card":
        """The card of a datasheet, by the name torch reports ('Tesla T4') or the sheet's ('T4'); ``cpus``: the
        host's cores (default: the card's typical host, ``TYPICAL_CPUS``)."""
        sheet = datasheets.SHEETS.get(name) or datasheets.find(name)
        if sheet is None:
            known = ", ".join(datasheets.SHEETS)
            raise ValueError(f"no datasheet for {name!r}: the course knows {known}")
        return cls(name, sheet, cpus or TYPICAL_CPUS.get(sheet.name, DEFAULT_CPUS), gpus)

    @classmethod
    def here(cls, device=None, *, quick: bool = False) -> "Card":
        """This machine's card (the course's device): its datasheet where one is listed; on a CPU, the CPU (quick
        mode), or an H100 where full mode was asked for on a CPU."""
        from ..conditions import cpu_cores

        cpus = cpu_cores() or os.cpu_count() or 1
        if not on_gpu(device):
            if quick:
                return cls("CPU", None, cpus, 0)
            return replace(cls.named(FULL_ON_CPU, cpus=cpus),
                           note=f"no GPU here: full mode (GPULAB_QUICK=0) plans as an {FULL_ON_CPU}")
        props = torch.cuda.get_device_properties(device or 0)
        gpus = torch.cuda.device_count()
        sheet = datasheets.find(props.name)
        if sheet is not None:
            return cls(props.name, sheet, cpus, gpus)
        sheet, donor = unlisted_sheet(props)
        return cls(props.name, sheet, cpus, gpus, props.total_memory / 1e9,
                   note=f"{props.name} has no datasheet here: its architecture, memory, SMs and L2 as CUDA reports "
                        f"them; its TFLOP/s and memory bandwidth are guesses, the {donor.name}'s per SM times its "
                        f"{sheet.sms} SMs, and its PCIe link and power the {donor.name}'s")

    # ---- facts -------------------------------------------------------------------------------------------------

    @property
    def is_gpu(self) -> bool:
        return self.sheet is not None

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.sheet.compute_capability if self.sheet else (0, 0)

    @property
    def sm(self) -> str:
        """The architecture as CUDA names it: 'sm_75'."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def bf16_native(self) -> bool:
        return self.compute_capability >= AMPERE

    @property
    def tf32(self) -> bool:
        return self.compute_capability >= AMPERE

    @property
    def fp8(self) -> bool:
        return self.compute_capability >= FP8_FROM

    @property
    def flash_attention(self) -> bool:
        """SDPA's flash and cuDNN backends: sm_80 and newer (torch's sdp_utils.cpp, ``check_sm_version``)."""
        return self.compute_capability >= AMPERE

    @property
    def gpm(self) -> bool:
        """NVML's GPU performance monitoring (SM occupancy, tensor activity): Hopper and newer."""
        return self.compute_capability >= HOPPER

    @property
    def amp_precision(self) -> str:
        """The precision autocast trains in: bf16 where native, else fp16 (with a GradScaler); fp32 on a CPU card."""
        return "bf16" if self.bf16_native else "fp16" if self.is_gpu else "fp32"

    def tflops(self, precision: str) -> float:
        """The matmul TFLOP/s a program reaches in ``precision``: the datasheet's dense peak times ``achievable``'s
        share (0 where the card does not run it natively)."""
        peak = self.sheet.tflops.get(precision) if self.sheet else None
        return peak * achievable()[precision] if peak else 0.0

    @property
    def copy_gbs(self) -> float:
        """Device memory's bandwidth as a copy reaches it, GB/s (read + write)."""
        return self.sheet.bandwidth_gbs * achievable()["copy"] if self.sheet else 0.0

    @property
    def host_gbs(self) -> float:
        """Pinned host-to-device copies over the card's PCIe link, GB/s."""
        if not self.sheet:
            return 0.0
        generation, lanes = self.sheet.pcie
        return PCIE_LANE_GBPS[generation] * lanes * achievable()["host"]

    @property
    def launch_s(self) -> float:
        return achievable()["launch_s"]

    @property
    def cpu_tflops(self) -> float:
        """The host's fp32 matmul TFLOP/s on all its cores (one core's rate on the H100's VM, times the cores)."""
        return achievable()["cpu_core_tflops"] * self.cpu_cores

    def usable_gb(self, share: float = 0.75) -> float:
        """The memory a plan may fill: ``share`` of the card's, the rest left to the CUDA context, the driver's
        reserve (a T4's ECC alone takes a sixteenth) and the allocator's fragmentation."""
        return share * self.memory_gb

    def lacks(self, features=FEATURES) -> list[str]:
        """What this card lacks of ``features`` (names of ``FEATURES``), each with what it changes."""
        if not self.is_gpu:
            return ["a GPU: quick mode, small sizes; the GPU's experiments show reference results instead"]
        has = {"bf16": self.bf16_native, "tf32": self.tf32, "flash attention": self.flash_attention, "fp8": self.fp8,
               "gpm": self.gpm, "second gpu": self.gpus >= 2}
        return [FEATURES[f] for f in features if not has[f]]

    def __str__(self) -> str:
        if not self.is_gpu:
            return f"{self.name} ({self.cpu_cores} cores)"
        s = self.sheet
        peaks = ", ".join(f"{p} {s.tflops[p]:g}" for p in ("fp32", "tf32", "fp16", "bf16", "fp8") if p in s.tflops)
        generation, lanes = s.pcie
        return (f"{self.name} ({self.sm}, {self.memory_gb:.0f} GB at {s.bandwidth_gbs:g} GB/s, dense TFLOP/s {peaks}, "
                f"PCIe Gen{generation} x{lanes}, {s.power_w:g} W); host: {self.cpu_cores} CPU cores"
                + (f", {self.gpus} GPUs" if self.gpus > 1 else "") + (f". {self.note}" if self.note else ""))


def precisions_of(capability: tuple[int, int]) -> set[str]:
    """The matmul precisions a card of ``capability`` runs natively, as the datasheets list them."""
    return {"fp32", "fp16"} | ({"tf32", "bf16"} if capability >= AMPERE else set()) | (
        {"fp8"} if capability >= FP8_FROM else set())


def unlisted_sheet(props) -> tuple[datasheets.Sheet, datasheets.Sheet]:
    """The facts of a card the datasheets do not list (``props``: torch's device properties), and the listed card its
    guesses come from: its architecture, memory, SMs and L2 as CUDA reports them; its TFLOP/s and memory bandwidth
    those of the listed card with the same precisions that is slowest per SM, per SM times its SMs (a plan from a slow
    guess runs short rather than long); that card's PCIe link and power."""
    capability, sms = (props.major, props.minor), props.multi_processor_count
    precisions = precisions_of(capability)
    donor = min((s for s in datasheets.SHEETS.values() if set(s.tflops) == precisions),
                key=lambda s: s.tflops["fp16"] / s.sms)
    per_sm = sms / donor.sms
    sheet = datasheets.Sheet(
        props.name, {p: rate * per_sm for p, rate in donor.tflops.items()},
        f"guessed: CUDA's properties, and the {donor.name}'s rates per SM", memory_gib=props.total_memory / 2**30,
        bandwidth_gbs=donor.bandwidth_gbs * per_sm, pcie=donor.pcie, power_w=donor.power_w,
        compute_capability=capability, sms=sms, l2_mib=props.L2_cache_size / 2**20)
    return sheet, donor
