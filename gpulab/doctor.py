"""`gpulab doctor`: why is training slow, or not on the GPU at all? Each finding has a fix.

Exit status of the command: 0 when every finding is OK or informational, 1 when the worst is a
warning (the GPU works but something costs speed), 2 when it is an error (the GPU is not used).
"""

import importlib.metadata
import os
import time
from dataclasses import asdict, dataclass
from enum import IntEnum

import torch

from . import nvml
from .device import on_gpu


class Severity(IntEnum):
    OK = 0
    WARNING = 1
    ERROR = 2


@dataclass(frozen=True)
class Finding:
    check: str
    severity: Severity
    summary: str
    fix: str = ""

    def as_dict(self) -> dict:
        return {**asdict(self), "severity": self.severity.name.lower()}


def diagnose() -> list[Finding]:
    """Run every check; the GPU checks only where there is a GPU (``gpulab.on_gpu``), the NVML ones where NVML works."""
    findings = [_torch_build(), _launch_blocking()]
    driver_cuda = _driver_cuda_version()
    device = machine_device()
    if not on_gpu(device):
        findings.append(_no_gpu(driver_cuda))
    else:
        findings += [_driver_matches(driver_cuda), _tensor_lands_on_gpu(device), _cudnn(device)]
    findings += _nvml_findings()
    return findings


def machine_device() -> torch.device:
    """The device the checks examine: the first GPU where torch's CUDA runtime works, else the CPU. Asking the runtime
    itself (``torch.cuda.is_available()``) is what doctor is for, so it is not the course's choice of device
    (``$GPULAB_DEVICE``); ``gpulab.on_gpu`` then says whether it is a GPU (under the tests' CUDA stand-in, the CPU)."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def exit_status(findings: list[Finding]) -> int:
    return int(max((f.severity for f in findings), default=Severity.OK))


def render(findings: list[Finding]) -> str:
    marks = {Severity.OK: "ok  ", Severity.WARNING: "WARN", Severity.ERROR: "FAIL"}
    lines = []
    for f in findings:
        lines.append(f"[{marks[f.severity]}] {f.check}: {f.summary}")
        if f.fix and f.severity:
            lines.append(f"       fix: {f.fix}")
    worst = Severity(exit_status(findings))
    verdict = {
        Severity.OK: "This machine is ready for the course.",
        Severity.WARNING: "The GPU works, but fix the warnings above: they cost speed.",
        Severity.ERROR: "The GPU is not being used. Fix the failures above (the course still runs on CPU, in quick mode).",
    }[worst]
    return "\n".join([*lines, "", verdict])


def _torch_build() -> Finding:
    if torch.version.cuda is None:
        return Finding(
            "torch build", Severity.ERROR,
            f"torch {torch.__version__} is a CPU-only build: it can never use a GPU",
            "reinstall a CUDA build: pip install --force-reinstall torch --index-url "
            "https://download.pytorch.org/whl/cu126 (pick the CUDA version your driver supports)",
        )
    return Finding("torch build", Severity.OK, f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")


def _launch_blocking() -> Finding:
    if os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        return Finding(
            "CUDA_LAUNCH_BLOCKING", Severity.WARNING,
            "CUDA_LAUNCH_BLOCKING is set: every kernel launch waits for the GPU, which serialises everything",
            "unset CUDA_LAUNCH_BLOCKING (it is a debugging aid only)",
        )
    return Finding("CUDA_LAUNCH_BLOCKING", Severity.OK, "not set")


def _driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed driver supports, from NVML."""
    try:
        with nvml.session() as nv:
            v = nv.nvmlSystemGetCudaDriverVersion()
    except nvml.NvmlUnavailable:
        return None
    return v // 1000, (v % 1000) // 10


def _no_gpu(driver_cuda) -> Finding:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Finding(
            "GPU visible to torch", Severity.ERROR,
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from torch",
            "unset CUDA_VISIBLE_DEVICES, or set it to the GPU index you want (e.g. 0)",
        )
    if torch.version.cuda is None:
        return Finding(
            "GPU visible to torch", Severity.ERROR, "torch sees no GPU because it is a CPU-only build",
            "see 'torch build' above",
        )
    if driver_cuda is None:
        return Finding(
            "GPU visible to torch", Severity.ERROR,
            "torch sees no CUDA GPU, and no NVIDIA driver answers on this machine (no GPU, or no driver)",
            "on Colab: Runtime > Change runtime type > GPU. On your own machine: install the NVIDIA driver "
            "(nvidia-smi must work). Without a GPU the course runs in quick mode on the CPU.",
        )
    if _version(torch.version.cuda)[0] > driver_cuda[0]:
        return _driver_too_old(driver_cuda, Severity.ERROR)
    if _version(torch.version.cuda) > driver_cuda:
        return Finding(
            "GPU visible to torch", Severity.ERROR,
            f"torch cannot initialise the GPU. Its CUDA {torch.version.cuda} is newer than the driver's "
            f"{driver_cuda[0]}.{driver_cuda[1]}: the same major version normally runs under CUDA minor-version "
            "compatibility, but not what needs a newer driver (e.g. PTX code for a GPU newer than the torch build)",
            f"update the NVIDIA driver to one for CUDA {torch.version.cuda}, or install a torch build for CUDA "
            f"{driver_cuda[0]}.{driver_cuda[1]} or older",
        )
    return Finding(
        "GPU visible to torch", Severity.ERROR,
        f"the driver answers (CUDA {driver_cuda[0]}.{driver_cuda[1]}) but torch cannot initialise the GPU",
        "run nvidia-smi; check that no other process holds the GPU in exclusive mode; restart the runtime",
    )


def _driver_too_old(driver_cuda, severity) -> Finding:
    return Finding(
        "driver vs torch", severity,
        f"torch is built for CUDA {torch.version.cuda}, the driver supports at most CUDA "
        f"{driver_cuda[0]}.{driver_cuda[1]}",
        "update the NVIDIA driver, or install a torch build for an older CUDA (see pytorch.org/get-started)",
    )


def _driver_matches(driver_cuda) -> Finding:
    if driver_cuda is None:
        return Finding("driver vs torch", Severity.OK,
                       f"torch initialised CUDA with its CUDA {torch.version.cuda}, so the driver runs it (the driver's "
                       "own CUDA version comes from NVML: see 'NVML')")
    if _version(torch.version.cuda)[0] > driver_cuda[0]:
        return _driver_too_old(driver_cuda, Severity.WARNING)
    if _version(torch.version.cuda) > driver_cuda:
        return Finding(
            "driver vs torch", Severity.OK,
            f"torch's CUDA {torch.version.cuda} is newer than the driver's {driver_cuda[0]}.{driver_cuda[1]}, same major "
            "version: it runs under CUDA minor-version compatibility (what needs a newer driver fails, e.g. PTX code "
            "compiled by a newer CUDA; update the driver if you meet such an error)",
        )
    return Finding(
        "driver vs torch", Severity.OK,
        f"driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]} >= torch's CUDA {torch.version.cuda}",
    )


def _tensor_lands_on_gpu(device: torch.device) -> Finding:
    """A tensor made on the GPU and a value read back: the first use of the CUDA runtime (GPU-only by nature)."""
    start = time.perf_counter()
    try:
        x = torch.arange(1000, device=device, dtype=torch.float32)
        total = (x * 2).sum().item()
    except RuntimeError as err:
        return Finding("tensor on GPU", Severity.ERROR, f"a tensor could not be used on the GPU: {err}",
                       "run nvidia-smi and restart the runtime; the GPU may be in a bad state")
    seconds = time.perf_counter() - start
    if not on_gpu(x.device) or total != 999000.0:
        return Finding("tensor on GPU", Severity.ERROR, f"wrong result on {x.device}: {total}", "restart the runtime")
    name = torch.cuda.get_device_name(x.device)
    return Finding("tensor on GPU", Severity.OK, f"computed on {x.device} ({name}); first use took {seconds:.2f} s")


def _cudnn(device: torch.device) -> Finding:
    """A convolution on the GPU, which cuDNN runs there (GPU-only by nature)."""
    if not torch.backends.cudnn.is_available():
        return Finding("cuDNN", Severity.WARNING, "cuDNN is not available: convolutions will be slow",
                       "install a torch build that bundles cuDNN (the default pip wheels do)")
    try:
        conv = torch.nn.Conv2d(3, 8, 3).to(device)
        conv(torch.randn(1, 3, 16, 16, device=device)).sum().item()
    except RuntimeError as err:
        return Finding("cuDNN", Severity.ERROR, f"a convolution failed on the GPU: {err}", "reinstall torch")
    return Finding("cuDNN", Severity.OK, f"cuDNN {torch.backends.cudnn.version()}, a convolution ran")


def _nvml_findings() -> list[Finding]:
    try:
        with nvml.session() as nv:
            count = nv.nvmlDeviceGetCount()
            return [_nvml_works(nv, count), *(finding for i in range(count) for finding in _gpu_health(nv, i))]
    except nvml.NvmlUnavailable as err:
        return [_nvml_unreachable(err)]


def _nvml_works(nv, count: int) -> Finding:
    driver = nvml.query(nv, nv.nvmlSystemGetDriverVersion, default="?")
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return Finding("NVML", Severity.OK, f"NVIDIA driver {driver} answers through {_nvidia_ml_py()}: {count} GPU(s)")


def _nvml_unreachable(err: nvml.NvmlUnavailable) -> Finding:
    """What keeps NVML away, with the fix for that cause: the Python module (pip), or the driver's library (not pip)."""
    if err.module_missing:
        return Finding("NVML", Severity.WARNING,
                       "the nvidia-ml-py package (module pynvml) is not installed: the course cannot read the GPU's "
                       "clocks, temperature, power or utilisation",
                       "pip install nvidia-ml-py")
    reason = err.reason  # NVML's own error
    if on_gpu(machine_device()):
        return Finding("NVML", Severity.WARNING,
                       f"{_nvidia_ml_py()} is installed, but NVML did not start ({reason}): torch reaches the GPU, so "
                       "the driver is loaded, but its NVML library (libnvidia-ml.so.1) is not reachable from this "
                       "process; clocks, temperature, power and utilisation cannot be read",
                       "NVML comes with the NVIDIA driver, not with pip: in a container, start it with the NVIDIA "
                       "Container Toolkit and the 'utility' capability (docker run --gpus all, or "
                       "NVIDIA_DRIVER_CAPABILITIES=compute,utility) so that libnvidia-ml.so.1 and nvidia-smi are there; "
                       "on your own machine, reinstall the NVIDIA driver until nvidia-smi works")
    return Finding("NVML", Severity.WARNING,
                   f"{_nvidia_ml_py()} is installed, but NVML did not start ({reason}): no NVIDIA driver answers here",
                   "NVML comes with the NVIDIA driver, not with pip: see 'GPU visible to torch' (nvidia-smi must work)")


def _nvidia_ml_py() -> str:
    try:
        return f"nvidia-ml-py {importlib.metadata.version('nvidia-ml-py')}"
    except importlib.metadata.PackageNotFoundError:  # pynvml from another distribution
        return "pynvml"


def _gpu_health(nv, index: int) -> list[Finding]:
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as err:  # a container may be refused one GPU (NO_PERMISSION) and granted the others
        return [Finding(f"GPU {index}", Severity.WARNING, f"NVML refused to read this GPU ({err})",
                        "in a container, start it with the NVIDIA Container Toolkit and this GPU among its devices")]
    name = nvml.query(nv, nv.nvmlDeviceGetName, h, default="GPU")
    name = name.decode() if isinstance(name, bytes) else name
    tag = f"GPU {index} ({name})"
    temp = nvml.query(nv, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
    sm = nvml.query(nv, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
    sm_max = nvml.query(nv, nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
    clocks = (f"SM clock {_or_unknown(sm)} of {_or_unknown(sm_max)} MHz, "
              f"{'temperature unknown' if temp is None else f'{temp} °C'}")
    return [Finding(f"{tag} clocks", Severity.OK, clocks), _throttling(nv, h, tag), _other_processes(nv, h, tag)]


def _or_unknown(value) -> str:
    return "unknown" if value is None else str(value)


# NVML's reasons (gpulab.nvml's names) that slow the clocks for heat or power, and what each means
_SLOWED = {
    "HW slowdown": "hardware slowdown (overheating or power brake)",
    "HW thermal slowdown": "hardware thermal slowdown",
    "power brake": "external power brake",
    "SW thermal slowdown": "software thermal slowdown",
    "SW power cap": "power cap reached",
}


def _throttling(nv, h, tag) -> Finding:
    bits = nvml.reason_bits(nv, h)
    if bits is None:
        return Finding(f"{tag} throttling", Severity.OK, "not reported by this driver")
    active = [_SLOWED[name] for name in nvml.decode_reasons(bits) if name in _SLOWED]
    if active:
        return Finding(f"{tag} throttling", Severity.WARNING, "clocks held back: " + "; ".join(active),
                       "check cooling and power limits (nvidia-smi -q -d PERFORMANCE); do not benchmark while it lasts")
    return Finding(f"{tag} throttling", Severity.OK, "no thermal or power throttling")


def _other_processes(nv, h, tag) -> Finding:
    procs = nvml.query(nv, nv.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
    others = [p for p in procs if p.pid != os.getpid()]
    if others:
        used = sum((p.usedGpuMemory or 0) for p in others) / 1e9
        pids = ", ".join(str(p.pid) for p in others[:5])
        return Finding(f"{tag} other processes", Severity.WARNING,
                       f"{len(others)} other process(es) use this GPU (pids {pids}; {used:.1f} GB)",
                       "they share the GPU's time and memory with you: stop them before measuring")
    return Finding(f"{tag} other processes", Severity.OK, "no other process is using it")


def _version(text: str) -> tuple[int, int]:
    major, minor, *_ = (int(part) for part in text.split("."))
    return major, minor
