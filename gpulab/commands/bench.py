"""`gpulab bench`: a few measurements that say whether a machine is healthy and fast."""

import torch
from tqdm.auto import tqdm

from ..device import device_info, get_device, on_gpu
from ..mode import by_mode
from ..precision import matmul_flops, matmul_peak
from ..results import ResultLog
from ..timing import bench

GB = 1e9


def _matmul(device, dtype) -> dict:
    """The matmul peak, measured as precision.matmul_peak does (warmed up, back to back, CUDA events)."""
    peak = matmul_peak(dtype, device)
    return dict(value=peak.tflops, unit="TFLOP/s", runs=peak.products,
                median_s=matmul_flops(peak.n, peak.n, peak.n) / (peak.tflops * 1e12),
                detail=f"n={peak.n}; fastest product {peak.best_tflops:.4g}; first products {peak.first_tflops:.4g}")


def _copy(device, nbytes) -> dict:
    x = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    m = bench(y.copy_, x, label="memory copy", device=device)
    return _row(m, 2 * nbytes / m.median / GB, "GB/s (read + write)", detail=f"{m.cache} cache")


def _host_to_device(device, nbytes, pinned) -> dict:
    x = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    x = x.pin_memory() if pinned else x
    y = torch.empty(x.shape, device=device)
    m = bench(y.copy_, x, label="host to device", device=device)
    return _row(m, nbytes / m.median / GB, "GB/s")


def _launch(device) -> dict:
    x = torch.zeros(1, device=device)
    m = bench(x.add_, 1, label="tiny add", device=device)
    return _row(m, m.median * 1e6, "µs per op")


def _row(m, value, unit, detail="") -> dict:
    return dict(value=value, unit=unit, runs=m.runs, median_s=m.median, iqr_s=m.iqr, detail=detail)


def run_benchmarks(device=None) -> list[dict]:
    """Measure; every row is also appended to results/bench.csv. Returns the rows."""
    device = get_device(device)
    info = device_info(device)
    cuda = on_gpu(device)
    nbytes = by_mode(1 << 30 if cuda else 1 << 28, 1 << 24)
    dtypes = [torch.float32] + ([torch.float16] if cuda else []) + ([torch.bfloat16] if info.bf16_native else [])
    tasks = [(f"matmul peak {str(d).removeprefix('torch.')}", _matmul, (device, d)) for d in dtypes]
    tasks.append((f"memory copy {nbytes / GB:.2g} GB", _copy, (device, nbytes)))
    if cuda:
        tasks += [(f"host→device pinned {nbytes / GB:.2g} GB", _host_to_device, (device, nbytes, True)),
                  (f"host→device pageable {nbytes / GB:.2g} GB", _host_to_device, (device, nbytes, False))]
    tasks.append(("launch of a tiny op", _launch, (device,)))

    log, rows = ResultLog("bench", device=str(device)), []
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 here
    for name, fn, args in tqdm(tasks, desc="gpulab bench", unit="test"):
        row = fn(*args)
        rows.append(log.add(test=name, **{**row, "value": round(row["value"], 3)}))
    if cuda and info.pcie:
        for row in rows:
            if row["test"].startswith("host→device"):
                row["of_limit"] = f"{row['value'] / info.pcie.max_gbps:.0%} of PCIe {info.pcie.max_gbps:.1f} GB/s"
    return rows
