"""`gpulab bench`: a few measurements that say whether a machine is healthy and fast."""

import torch
from tqdm.auto import tqdm

from .device import device_info, get_device
from .mode import by_mode
from .results import ResultLog
from .timing import bench

GB = 1e9


def _matmul(device, dtype, n):
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    m = bench(torch.mm, a, b, label=f"matmul {dtype}", device=device, min_time=by_mode(1.0, 0.2))
    return m, 2 * n**3 / m.median / 1e12, "TFLOP/s"


def _copy(device, nbytes):
    x = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    m = bench(y.copy_, x, label="memory copy", device=device)
    return m, 2 * nbytes / m.median / GB, "GB/s (read + write)"


def _host_to_device(device, nbytes, pinned):
    x = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    x = x.pin_memory() if pinned else x
    y = torch.empty(x.shape, device=device)
    m = bench(y.copy_, x, label="host to device", device=device)
    return m, nbytes / m.median / GB, "GB/s"


def _launch(device):
    x = torch.zeros(1, device=device)
    m = bench(x.add_, 1, label="tiny add", device=device)
    return m, m.median * 1e6, "µs per op"


def run_benchmarks(device=None) -> list[dict]:
    """Measure; every row is also appended to results/bench.csv. Returns the rows."""
    device = get_device(device)
    info = device_info(device)
    cuda = device.type == "cuda"
    n = by_mode(8192 if cuda else 2048, 512)
    nbytes = by_mode(1 << 30 if cuda else 1 << 28, 1 << 24)
    dtypes = [torch.float32] + ([torch.float16] if cuda else []) + ([torch.bfloat16] if info.bf16_native else [])
    tasks = [(f"matmul {n}x{n} {str(d).removeprefix('torch.')}", _matmul, (device, d, n)) for d in dtypes]
    tasks.append((f"memory copy {nbytes / GB:.2g} GB", _copy, (device, nbytes)))
    if cuda:
        tasks += [(f"host→device pinned {nbytes / GB:.2g} GB", _host_to_device, (device, nbytes, True)),
                  (f"host→device pageable {nbytes / GB:.2g} GB", _host_to_device, (device, nbytes, False))]
    tasks.append(("launch of a tiny op", _launch, (device,)))

    log, rows = ResultLog("bench", device=str(device)), []
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    for name, fn, args in tqdm(tasks, desc="gpulab bench", unit="test"):
        m, value, unit = fn(*args)
        rows.append(log.add(test=name, value=round(value, 3), unit=unit, median_s=m.median, iqr_s=m.iqr, runs=m.runs))
    if cuda and info.pcie:
        for row in rows:
            if row["test"].startswith("host→device"):
                row["of_limit"] = f"{row['value'] / info.pcie.max_gbps:.0%} of PCIe {info.pcie.max_gbps:.1f} GB/s"
    return rows
