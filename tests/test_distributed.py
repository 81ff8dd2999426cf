"""gpulab.distributed: torchrun launched from Python (gloo on the CPU), nccl-tests' bus bandwidth, the scaling model."""

import textwrap
from pathlib import Path

import psutil
import pytest

from gpulab import distributed
from gpulab.distributed import (
    BUS_FACTORS,
    TOPOLOGIES,
    BadResult,
    LaunchFailed,
    Link,
    Topology,
    bus_bandwidth,
    ddp_step_seconds,
    fit_link,
    interleaved,
    rank_counts,
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
    run = torchrun(_script(tmp_path, ALL_REDUCE), nproc=2, time_limit=300)
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
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=300, echo=False)
    assert run.ok, run.failure()
    for rank in (0, 1):
        assert [row["i"] for row in run.results(rank)] == list(range(2000))
    assert len(run.results(rank=None)) == 4000


def test_a_failing_rank_is_named_with_its_error(tmp_path):
    # rank 1 fails before it joins, so rank 0 only waits until torchrun stops it. After a collective, rank 0 would
    # fail too ("Connection closed by peer"); should torchrun see both exits in one poll, their whole-second
    # timestamps tie and it names rank 0 as the root cause.
    body = ALL_REDUCE.replace('dist.init_process_group("gloo")',
                              'if os.environ["RANK"] == "1":\n    raise ValueError("bad shard")\ndist.init_process_group("gloo")')
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=300, echo=False)
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
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=300, echo=False)
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
    run = torchrun(_script(tmp_path, body), nproc=2, time_limit=45, echo=False)
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
    assert comm == pytest.approx(1.0) and link.allreduce_seconds(1e9, 2) == comm
    assert ddp_step_seconds(1.0, 1e9, 2, link) == pytest.approx(2.0)  # nothing overlapped
    assert ddp_step_seconds(1.0, 1e9, 2, link, overlap=0.5) == pytest.approx(1.5)
    assert ddp_step_seconds(3.0, 1e9, 2, link, overlap=2 / 3) == pytest.approx(3.0)  # fully hidden
    assert ddp_step_seconds(1.0, 1e9, 1, link) == 1.0  # one GPU: no all-reduce
    with pytest.raises(ValueError, match="fraction"):
        ddp_step_seconds(1.0, 1e9, 2, link, overlap=1.5)
    table = scaling_table(0.1, 100e6, [1, 8, 64])
    assert set(table["link"]) == {t.name for t in TOPOLOGIES}
    assert (table["efficiency"] <= 1).all() and table.groupby("link")["efficiency"].is_monotonic_decreasing.all()


def test_ddp_overhead_is_part_of_every_step_and_of_the_efficiency():
    link = Link("slow", bandwidth=1e9, latency=0.0)
    assert ddp_step_seconds(1.0, 1e9, 1, link, overhead_s=0.25) == pytest.approx(1.25)
    assert ddp_step_seconds(1.0, 1e9, 2, link, overhead_s=0.25) == pytest.approx(2.25)
    table = scaling_table(1.0, 1e9, [1, 2], links=[link], overhead_s=0.25).set_index("gpus")
    assert table.efficiency[1] == 1.0 and table.efficiency[2] == pytest.approx(1.25 / 2.25)  # step(1) / step(2)
    assert table.speedup[2] == pytest.approx(2 * 1.25 / 2.25)
    with pytest.raises(ValueError, match="overhead_s"):
        ddp_step_seconds(1.0, 1e9, 2, link, overhead_s=-1)


# ----- topologies: NVLink inside a node, a network between nodes ---------------------------------------

def test_an_nvlink_domain_is_one_node_of_8_and_nodes_talk_over_infiniband():
    h100 = next(t for t in TOPOLOGIES if "H100" in t.name)
    assert h100.gpus_per_node == 8 and "NVLink" in h100.intra.name and "InfiniBand" in h100.inter.name
    nbytes = 1e9
    # inside a node: a ring over NVLink alone
    assert h100.allreduce_seconds(nbytes, 8) == pytest.approx(ring_allreduce_seconds(nbytes, 8, h100.intra))
    # 16 GPUs = 2 nodes: a ring inside each node, and each GPU's eighth over InfiniBand between the nodes
    across = ring_allreduce_seconds(nbytes, 8, h100.intra) + ring_allreduce_seconds(nbytes / 8, 2, h100.inter)
    assert h100.allreduce_seconds(nbytes, 16) == pytest.approx(across)
    assert h100.allreduce_seconds(nbytes, 16) > ring_allreduce_seconds(nbytes, 16, h100.intra)  # not a 16-GPU NVLink ring
    assert not h100.fits(12) and h100.fits(64)
    with pytest.raises(ValueError, match="whole number of nodes"):
        h100.allreduce_seconds(nbytes, 12)


def test_a_topology_without_a_network_stops_at_its_node_and_no_flat_ring_spans_64_gpus():
    workstation = next(t for t in TOPOLOGIES if t.inter is None)
    assert workstation.max_gpus() == workstation.gpus_per_node and not workstation.fits(workstation.gpus_per_node + 1)
    with pytest.raises(ValueError, match="no network between nodes"):
        workstation.allreduce_seconds(1e6, 64)
    table = scaling_table(0.01, 100e6, [1, 2, 4, 8, 16, 64])
    for topology in TOPOLOGIES:
        counts = set(table[table.link == topology.name].gpus)
        assert counts == {n for n in (1, 2, 4, 8, 16, 64) if topology.fits(n)}
        if topology.inter is not None:  # beyond a node, the network is in the estimate: efficiency drops there
            assert table[(table.link == topology.name) & (table.gpus == 64)].comm_s.iloc[0] > \
                   topology.intra.allreduce_seconds(100e6, 8)
    assert all(t.gpus_per_node <= 8 for t in TOPOLOGIES)  # no NVLink or PCIe domain larger than a node
    with pytest.raises(ValueError):
        Topology("none", 0, Link("x", 1e9, 0.0))


# ----- how many ranks, how much work -------------------------------------------------------------------

@pytest.mark.parametrize("gpus, counts", [(0, [1, 2]), (1, [1, 2]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]),
                                          (5, [1, 2, 4, 5]), (6, [1, 2, 4, 6]), (7, [1, 2, 4, 7]), (8, [1, 2, 4, 8])])
def test_the_largest_run_uses_every_gpu(gpus, counts):
    assert rank_counts(gpus) == counts
    if gpus >= 2:
        assert max(rank_counts(gpus)) == gpus  # DataParallel on every GPU meets DDP on as many


def test_interleaved_alternates_the_order_and_pairs_blocks_that_saw_the_same_load():
    order, now = [], [0.0]
    load = [1.0]

    def make(name, cost):
        def fn():
            order.append(name)
            now[0] += cost * load[0]
        return fn

    def before():
        load[0] = 1.0 + len(order) / 10  # the machine slows down as the timing goes on

    times = interleaved({"A": make("A", 1.0), "B": make("B", 2.0)}, rounds=4, calls=2, warmup=1, before=before,
                        clock=lambda: now[0])
    assert order[:2] == ["A", "B"]  # warm-up
    blocks = order[2:]
    assert blocks == ["A", "A", "B", "B", "B", "B", "A", "A", "A", "A", "B", "B", "B", "B", "A", "A"]
    assert len(times["A"]) == len(times["B"]) == 4
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    assert all(r == pytest.approx(2.0, rel=0.25) for r in ratios)  # each pair saw about the same load
    with pytest.raises(ValueError, match="rounds"):
        interleaved({"A": make("A", 1.0)}, rounds=0)
    with pytest.raises(ValueError, match="at least one"):
        interleaved({}, rounds=2)


# ----- bad inputs: one clear message each --------------------------------------------------------------

@pytest.mark.parametrize("nproc", [0, -1, 1.5, "2", True])
def test_torchrun_refuses_a_process_count_that_is_not_a_whole_number_of_1_or_more(tmp_path, nproc):
    with pytest.raises(ValueError, match="nproc is how many processes"):
        torchrun(_script(tmp_path, ALL_REDUCE), nproc=nproc)


def test_torchrun_refuses_a_time_limit_that_is_not_positive(tmp_path):
    with pytest.raises(ValueError, match="time_limit"):
        torchrun(_script(tmp_path, ALL_REDUCE), time_limit=0)


def _run_with(stdout: dict) -> distributed.Run:
    return distributed.Run(script=Path("job.py"), command=[], nproc=len(stdout), time_limit=1.0,
                           returncode=0, stdout=stdout)


def test_a_result_line_that_is_not_json_names_the_rank_and_the_line():
    run = _run_with({0: 'RESULT {"a": 1}\n', 1: 'hello\nRESULT {"a": 2, oops}\n'})
    assert run.results(0) == [{"a": 1}]
    with pytest.raises(BadResult, match=r"job.py: rank 1's line 2 .*not JSON.*oops") as error:
        run.results(rank=None)
    assert isinstance(error.value, ValueError) and error.value.__cause__ is None  # one message, no JSONDecodeError
    with pytest.raises(BadResult, match="not an object"):
        _run_with({0: "RESULT [1, 2]\n"}).results()


@pytest.mark.parametrize("seconds", [0, -1e-3, float("nan"), float("inf"), "fast"])
def test_bus_bandwidth_of_a_time_that_is_not_positive_says_so(seconds):
    with pytest.raises(ValueError, match="seconds"):
        bus_bandwidth("all_reduce", 1e6, seconds, 2)


def test_bus_bandwidth_refuses_a_rank_count_below_one():
    with pytest.raises(ValueError, match="number of ranks"):
        bus_bandwidth("all_reduce", 1e6, 1e-3, 0)


@pytest.mark.parametrize("sizes, seconds, words", [
    ([1024, 2048], [0.0, 1e-3], "above 0"),
    ([1024, 2048], [1e-3, float("nan")], "above 0"),
    ([1024, 2048, 4096], [1e-3, 2e-3], "one time per message size"),
    ([0, 2048], [1e-3, 2e-3], "sizes above 0"),
    ([1024, 1024], [1e-3, 2e-3], "two different"),
    ([2**20, 2**24], [1e-2, 1e-3], "do not grow with the message size"),
])
def test_fit_link_explains_times_it_cannot_fit(sizes, seconds, words):
    with pytest.raises(ValueError, match=words):
        fit_link(sizes, seconds, n=2)
