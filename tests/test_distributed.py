"""gpulab.distributed: torchrun launched from Python (gloo on the CPU), nccl-tests' bus bandwidth, the scaling model."""

import textwrap

import psutil
import pytest

from gpulab import distributed
from gpulab.distributed import (
    BUS_FACTORS,
    LaunchFailed,
    Link,
    bus_bandwidth,
    ddp_step_seconds,
    fit_link,
    ring_allreduce_seconds,
    scaling_table,
    torchrun,
)

ALL_REDUCE = """
import json, os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x)
print("hello from", rank)
print("RESULT " + json.dumps({"rank": rank, "sum": x[0].item(), "threads": os.environ.get("OMP_NUM_THREADS")}))
dist.barrier()
dist.destroy_process_group()
"""


def _script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_two_gloo_ranks_all_reduce_and_report(tmp_path, capsys):
    run = torchrun(_script(tmp_path, ALL_REDUCE), nproc=2, time_limit=120)
    assert run.ok, run.failure()
    rows = run.results(rank=None)
    assert sorted(r["rank"] for r in rows) == [0, 1] and {r["sum"] for r in rows} == {3.0}
    assert {r["threads"] for r in rows} == {"1"}  # torchrun sets OMP_NUM_THREADS=1 per rank
    shown = capsys.readouterr().out
    assert "[rank 0] hello from 0" in shown and "[rank 1] hello from 1" in shown and "RESULT" not in shown


def test_every_result_line_of_ranks_printing_at_once_is_read(tmp_path):
    body = """
    import json, os
    rank = int(os.environ["RANK"])
    for i in range(2000):
        print("RESULT", json.dumps({"rank": rank, "i": i, "pad": "x" * (i % 200)}))
    """
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=120, echo=False)
    assert run.ok, run.failure()
    for rank in (0, 1):
        assert [row["i"] for row in run.results(rank)] == list(range(2000))
    assert len(run.results(rank=None)) == 4000


def test_a_failing_rank_is_named_with_its_error(tmp_path):
    body = ALL_REDUCE.replace('print("hello from", rank)',
                              'if rank == 1:\n    raise ValueError("bad shard")\nprint("hello from", rank)')
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=120, echo=False)
    assert not run.ok and run.failed_rank() == 1
    assert "rank 1 failed: ValueError: bad shard" in run.failure()
    with pytest.raises(LaunchFailed, match="bad shard"):
        run.raise_for_failure()


def test_a_rank_that_crashes_without_an_exception_is_named_with_its_signal(tmp_path):
    body = """
    import os
    if os.environ["RANK"] == "1":
        print("about to abort", flush=True)
        os.abort()
    """
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=120, echo=False)
    assert not run.ok and run.failed_rank() == 1
    assert "rank 1 failed: exit code -6" in run.failure() and "SIGABRT" in run.failure()
    assert "'about to abort'" in run.failure()


def test_child_stderr_catches_what_children_write_to_the_descriptor(tmp_path):
    import subprocess
    import sys

    with distributed.child_stderr() as children:
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('from the child')"], check=True)
    assert children.text == "from the child"


def test_a_hang_is_stopped_at_the_time_limit_with_no_process_left(tmp_path):
    body = """
    import os, time
    print("pid", os.getpid(), flush=True)
    time.sleep(600)
    """
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=15, echo=False)
    assert run.timed_out and not run.ok and "time limit" in run.failure()
    pids = [int(text.split()[1]) for rank, text in run.lines if rank is not None and text.startswith("pid")]
    assert pids, run.lines
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_a_missing_script_says_which_cell_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="%%writefile"):
        torchrun(tmp_path / "nothere.py")


def test_free_port_is_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", distributed.free_port()))


def test_bus_bandwidth_uses_nccl_tests_factors():
    assert bus_bandwidth("all_reduce", 8e9, 1.0, 8) == pytest.approx(8e9 * 2 * 7 / 8)
    assert bus_bandwidth("all_gather", 8e9, 1.0, 4) == pytest.approx(8e9 * 3 / 4)
    assert BUS_FACTORS["broadcast"](16) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_bandwidth("all_to_everyone", 1, 1, 2)


def test_fit_link_recovers_a_ring_all_reduce():
    link = Link("true", bandwidth=20e9, latency=30e-6)
    sizes = [2**k for k in range(10, 28, 3)]
    fitted = fit_link(sizes, [ring_allreduce_seconds(b, 4, link) for b in sizes], n=4)
    assert fitted.bandwidth == pytest.approx(20e9, rel=1e-6) and fitted.latency == pytest.approx(30e-6, rel=1e-6)
    assert link.crossover_bytes(4) == pytest.approx(4 * 30e-6 * 20e9)
    with pytest.raises(ValueError):
        fit_link([1024], [1e-3], n=2)


def test_the_scaling_model_hides_communication_only_behind_compute():
    link = Link("slow", bandwidth=1e9, latency=0.0)
    comm = ring_allreduce_seconds(1e9, 2, link)  # 2 steps × 0.5 GB at 1 GB/s = 1 s
    assert comm == pytest.approx(1.0)
    assert ddp_step_seconds(1.0, 1e9, 2, link) == pytest.approx(2.0)  # nothing overlapped
    assert ddp_step_seconds(1.0, 1e9, 2, link, overlap=0.5) == pytest.approx(1.5)
    assert ddp_step_seconds(3.0, 1e9, 2, link, overlap=2 / 3) == pytest.approx(3.0)  # fully hidden
    assert ddp_step_seconds(1.0, 1e9, 1, link) == 1.0  # one GPU: no all-reduce
    with pytest.raises(ValueError, match="fraction"):
        ddp_step_seconds(1.0, 1e9, 2, link, overlap=1.5)
    table = scaling_table(0.1, 100e6, [1, 8, 64])
    assert set(table["link"]) == {link.name for link in distributed.VENDOR_LINKS}
    assert (table["efficiency"] <= 1).all() and table.groupby("link")["efficiency"].is_monotonic_decreasing.all()
