import functools
import inspect
import statistics
import timeit

import pandas as pd
import pytest
import torch

from gpulab import precision
from gpulab.commands import cli, timer_agreement


def test_bench_prints_a_table_and_records_every_test(results_dir, monkeypatch, capsys):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    assert cli.main(["bench", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "launch of a tiny op" in out and "ref: " in out and "n=" in out
    recorded = pd.read_csv(results_dir / "bench.csv")
    assert {"matmul peak float32", "launch of a tiny op"} <= set(recorded["test"])
    assert (recorded["value"] > 0).all() and recorded["quick"].all()


# ---- the timer comparison --------------------------------------------------------------------------------------


def test_timers_interleave_rotate_record_and_agree_roughly(results_dir, monkeypatch):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    table = timer_agreement.agreement("cpu", rounds=3)
    assert list(table.columns) == ["gpulab", "torch", "gpulab / torch", "spread"]
    assert "add, 1 element" in table.index and any(c.startswith("matmul") for c in table.index)
    assert (table["gpulab / torch"] == table["gpulab"] / table["torch"]).all()
    # Wall-clock agreement is for the report (`gpulab bench --timers` on a quiet machine): on a loaded one,
    # torch's longer blocks are preempted more often than bench's short runs, by up to the CPU share lost.
    # A per-call accounting error (a block not divided by its calls, seconds vs µs) is 10× or more.
    assert table["gpulab / torch"].between(0.1, 10).all()
    recorded = pd.read_csv(results_dir / "timers.csv")
    assert len(recorded) == 3 * len(table) * 2
    firsts = recorded.groupby("round")["timer"].first()
    assert firsts[0] != firsts[1]  # who goes first rotates from round to round


def test_bench_timers_command_prints_the_ratios(results_dir, monkeypatch, capsys):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    x = torch.ones(1000)
    monkeypatch.setattr(timer_agreement, "cases", lambda device: {"add": functools.partial(torch.add, x, x)})
    assert cli.main(["bench", "--timers", "--device", "cpu", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "gpulab / torch" in out and "cases within 5%" in out and "spread" in out


# ---- the matmul peak ----------------------------------------------------------------------------------------------


def test_peak_on_this_machine():
    peak = precision.matmul_peak(torch.float32, "cpu", sizes=[32, 64], warmup_s=0.01, min_time=0.01)
    assert peak.tflops == peak.by_size[peak.n] == max(peak.by_size.values())
    assert peak.best_tflops >= peak.tflops > 0 and peak.first_tflops > 0 and peak.products >= 10
    assert precision.measured_peak(torch.float32, "cpu", n=32)[1] == 32


def _fake_products(monkeypatch, tflops_at, spread=0.0):
    """Replace the timed products: each takes its FLOPs / ``tflops_at(n)``; the first of every batch is faster
    by ``spread``. Records (n, count, data) of every batch."""
    batches = []

    def timed(product, count, cuda):
        a, b = product.args
        n = a.shape[0]
        batches.append((n, count, a))
        seconds = precision.matmul_flops(n, n, n) / (tflops_at(n) * 1e12)
        return [seconds * (1 - spread)] + [seconds] * (count - 1)

    monkeypatch.setattr(precision, "timed_calls", timed)
    return batches


def test_peak_warms_up_then_times_back_to_back_products_of_random_data(monkeypatch):
    batches = _fake_products(monkeypatch, lambda n: 1.0)
    peak = precision.matmul_peak(torch.float32, "cpu", sizes=[64], warmup_s=0.05, min_time=0.5)
    warm, timed = batches[:-1], batches[-1]
    assert len(warm) > 3  # the first product, the first ten, then warm-up batches for 0.05 s
    assert timed[1] == peak.products >= 10 and peak.tflops == pytest.approx(1.0)
    data = timed[2]
    assert data.abs().sum() > 0 and 0.8 < data.std() < 1.2  # random normal numbers, not zeros or ones


def test_peak_is_the_median_at_the_fastest_size_not_the_fastest_product(monkeypatch):
    _fake_products(monkeypatch, {64: 1.0, 128: 2.0, 256: 1.5}.get, spread=0.9)
    peak = precision.matmul_peak(torch.float32, "cpu", sizes=[64, 128, 256], warmup_s=0, min_time=0.01)
    assert peak.n == 128 and peak.tflops == pytest.approx(2.0)
    assert peak.by_size == pytest.approx({64: 1.0, 128: 2.0, 256: 1.5})
    assert peak.best_tflops == pytest.approx(2.0 / 0.1)  # one fast outlier is reported, not called the peak


def test_peak_skips_sizes_whose_one_product_would_take_too_long(monkeypatch):
    batches = _fake_products(monkeypatch, lambda n: 1e-3)  # 1 GFLOP/s: 2·512³ FLOPs take 0.27 s
    peak = precision.matmul_peak(torch.float32, "cpu", sizes=[128, 256, 512], warmup_s=0, min_time=0.01)
    assert set(peak.by_size) == {128, 256} and {n for n, _, _ in batches} == {128, 256}


@pytest.mark.gpu
def test_gpu_peak_is_within_5_percent_of_a_longer_careful_run():
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    peak = precision.matmul_peak(dtype, "cuda")
    longer = precision.matmul_peak(dtype, "cuda", sizes=[peak.n], warmup_s=5, min_time=5)
    assert peak.tflops >= 0.95 * longer.tflops
    assert peak.best_tflops >= peak.tflops


# ---- on a GPU: the rows and timers only a GPU gets, on the CUDA stand-in -----------------------------------------------


def test_bench_on_a_gpu_adds_half_precision_and_the_host_link_against_pcie(cuda_stand_in, fake_nvml_card, results_dir,
                                                                          monkeypatch):
    """`gpulab bench`'s GPU rows (fp16 and bf16 peaks, pinned and pageable copies to the device, their share of the PCIe
    link that NVML reports), which no test ran: on the CPU playing an H200, with NVML's Gen5 x16 link."""
    from gpulab.commands import bench

    monkeypatch.setenv("GPULAB_QUICK", "1")
    rows = {row["test"]: row for row in bench.run_benchmarks()}
    assert list(rows) == ["matmul peak float32", "matmul peak float16", "matmul peak bfloat16", "memory copy 0.017 GB",
                          "host→device pinned 0.017 GB", "host→device pageable 0.017 GB", "launch of a tiny op"]
    assert rows["host→device pinned 0.017 GB"]["of_limit"].endswith("of PCIe 63.0 GB/s")
    assert all(row["value"] > 0 for row in rows.values())


def do_bench_on_the_host(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
    """triton.testing.do_bench's signature and answer (ms), timed on the host: the real one asks triton's active
    driver for the GPU and its L2 flush buffer (GPU-only)."""
    assert return_mode in ["min", "max", "mean", "median", "all"] and quantiles is None
    times = [timeit.timeit(fn, number=1) * 1e3 for _ in range(5)]
    return {"min": min, "max": max, "mean": statistics.mean, "median": statistics.median}[return_mode](times)


def test_on_a_gpu_the_timers_add_the_cold_cache_and_triton(cuda_stand_in, results_dir, monkeypatch):
    triton_testing = pytest.importorskip("triton.testing")
    assert inspect.signature(do_bench_on_the_host) == inspect.signature(triton_testing.do_bench)
    monkeypatch.setattr(triton_testing, "do_bench", do_bench_on_the_host)
    monkeypatch.setenv("GPULAB_QUICK", "1")
    cases = timer_agreement.cases  # its first two cases: each cold call writes the 256 MiB flush, slow on a CPU
    monkeypatch.setattr(timer_agreement, "cases", lambda device: dict(list(cases(device).items())[:2]))
    table = timer_agreement.agreement("cpu", rounds=2, min_time=0.005)
    assert list(table.columns) == ["gpulab", "torch", "gpulab cold", "triton", "gpulab / torch", "gpulab cold / triton",
                                   "spread"]
    assert (table["gpulab cold / triton"] == table["gpulab cold"] / table["triton"]).all()
    assert "gpulab cold / triton: " in timer_agreement.render(table)
