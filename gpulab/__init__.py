"""gpulab: the plumbing of the GPU-utilisation course (timing, device facts, results, plots, checks)."""

import os
import platform
import warnings

import torch

from . import datasheets
from .colab import on_colab
from .comparison import Comparison, compare
from .conditions import LOW_POWER_W, cpu_cores
from .device import device_info, get_device, on_gpu, sync
from .mode import by_mode, quick_mode
from .results import ResultLog, reference, reference_for, reference_provenance, results_dir
from .timing import Measurement, bench

__version__ = "0.1.0"
__all__ = [
    "Comparison", "Measurement", "ResultLog", "bench", "by_mode", "compare", "device_info", "get_device", "on_gpu",
    "quick_mode",
    "reference", "reference_for", "reference_provenance", "setup", "sync",
]


def setup(seed: int = 0) -> torch.device:
    """Start a lesson: seed torch, print the device, the mode and the versions, return the device."""
    if os.environ.get("GPULAB_STRICT_WARNINGS"):
        strict_warnings()
    torch.manual_seed(seed)
    device = get_device()
    info = device_info(device)
    mode = "quick" if quick_mode() else "full"
    print(f"gpulab {__version__} | device: {device} ({info.name}) | mode: {mode}")
    print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | Python {platform.python_version()}")
    if on_colab():
        print(f"Google Colab runtime with {cpu_cores()} vCPUs: timings share them with this notebook's own threads, "
              "and the caveats beside a timing say when threads waited for a core.")
    sheet = datasheets.find(info.name) if on_gpu(device) else None
    if sheet and sheet.power_w <= LOW_POWER_W:
        print(f"A {sheet.power_w:g} W card: it runs any sustained work at its power limit, below its top clock. "
              "Measurements say so; for this card it is the normal state, not a fault.")
    if not torch.cuda.is_available():
        # the profiler's Kineto, in a CUDA build of torch on a machine without a GPU, logs "gpuGetDeviceCount failed"
        # as an ERROR at its first use: noise here (its level 5 keeps fatal messages only; read when Kineto starts)
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    if not on_gpu(device):
        sizes = "small sizes, few repetitions" if mode == "quick" else "full sizes (GPULAB_QUICK=0): slow on a CPU"
        print(f"No GPU here: the lesson runs on the CPU in {mode} mode ({sizes}). Experiments that need a GPU say "
              "so, and show reference results measured on real GPUs where the course has them.")
    elif mode == "quick":
        print("Quick mode (CI or GPULAB_QUICK is set): small sizes, few repetitions. Unset it for real numbers.")
    else:
        print("Full mode: sizes are planned for this card (in a lesson, the plan printed next says how many minutes "
              "they take). For a few-minute run of small sizes, set GPULAB_QUICK=1 before this cell (on Colab: "
              "%env GPULAB_QUICK=1) and run it again.")
    print(f"Results are written to {results_dir()} (set GPULAB_RESULTS to change it).")
    return device


def strict_warnings() -> None:
    """Turn deprecation warnings into errors (tests set GPULAB_STRICT_WARNINGS so notebooks get it too)."""
    warnings.filterwarnings("error", message=r".*(deprecated|will be removed)", category=FutureWarning)
    warnings.filterwarnings("error", message=r".*deprecated", category=DeprecationWarning, module=r"torch(\.|$)")
