"""Lesson 07, more than one GPU: bus bandwidth from a timing, bytes per rank under DDP, ZeRO and FSDP, and
gradient accumulation with no_sync() (run on two gloo ranks by the check)."""

import gc
import inspect
import math
import tempfile
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import distributed
from ..check import Question, Wrong
from ..models import WideMLP

# ----- q1: bus bandwidth from a timing ---------------------------------------------------------------

_BANDWIDTH_CASES = [  # (op, nbytes, seconds, ranks)
    ("all_reduce", 64e6, 2e-3, 8),
    ("all_reduce", 1e6, 1e-4, 2),
    ("all_gather", 64e6, 1e-3, 4),
    ("reduce_scatter", 256e6, 4e-3, 8),
    ("all_reduce", 4096, 2e-5, 4),
]


def _check_bus_bandwidth(bus_bandwidth_gbs) -> str:
    if not callable(bus_bandwidth_gbs):
        raise Wrong("pass your function itself: `q1.check(bus_bandwidth_gbs)`")
    for op, nbytes, seconds, ranks in _BANDWIDTH_CASES:
        got = bus_bandwidth_gbs(op, nbytes, seconds, ranks)
        if isinstance(got, bool) or not isinstance(got, (int, float)) and not hasattr(got, "__float__"):
            raise Wrong(f"bus_bandwidth_gbs({op!r}, ...) should return a number of GB/s, got {type(got).__name__}")
        got, algbw = float(got), nbytes / seconds / 1e9
        expected = distributed.bus_bandwidth(op, nbytes, seconds, ranks) / 1e9
        if math.isclose(got, expected, rel_tol=1e-6):
            continue
        case = f"{op} of {nbytes:.4g} bytes in {seconds:g} s on {ranks} ranks"
        if math.isclose(got, algbw, rel_tol=1e-6):
            raise Wrong(f"{case}: {got:.4g} GB/s is the algorithm bandwidth (bytes / time); the bus bandwidth "
                        "multiplies it by what each rank's link carries in a ring, nccl-tests' factor")
        for factor, why in ((8, "GB/s counts bytes, not bits"), (1e9 / 2**30, "a GB is 10⁹ bytes here, as in "
                                                                               "nccl-tests, not 2³⁰")):
            if math.isclose(got, expected * factor, rel_tol=1e-6):
                raise Wrong(f"{case}: expected {expected:.4g} GB/s, got {got:.4g}: {why}")
        if op == "all_reduce" and math.isclose(got, algbw * (ranks - 1) / ranks, rel_tol=1e-6):
            raise Wrong(f"{case}: an all-reduce is a reduce-scatter followed by an all-gather, so each rank's link "
                        "carries the data twice: the factor is 2(n−1)/n, not (n−1)/n")
        if op != "all_reduce" and math.isclose(got, algbw * 2 * (ranks - 1) / ranks, rel_tol=1e-6):
            raise Wrong(f"{case}: {op} moves each byte over each link once: the factor is (n−1)/n; "
                        "2(n−1)/n is all-reduce's")
        raise Wrong(f"{case}: the bus bandwidth is {expected:.4g} GB/s, your function returned {got:.4g}")
    return "your bus bandwidths match nccl-tests' for all-reduce, all-gather and reduce-scatter at 2 to 8 ranks."


# ----- q2: bytes per rank under DDP, ZeRO-1, ZeRO-2 and FSDP -----------------------------------------

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "FSDP")
_SHARDED = {"DDP": (), "ZeRO-1": ("optimizer",), "ZeRO-2": ("gradients", "optimizer"),
            "FSDP": ("parameters", "gradients", "optimizer")}
_BYTES_PER_PARAMETER = {"parameters": 4, "gradients": 4, "optimizer": 8}  # float32, AdamW's two moments


def expected_bytes(num_params: int, ranks: int, strategy: str) -> dict:
    """What one rank holds, in bytes, training in float32 with AdamW (the ZeRO paper's accounting)."""
    return {part: size * num_params / (ranks if part in _SHARDED[strategy] else 1)
            for part, size in _BYTES_PER_PARAMETER.items()}


def _check_bytes(bytes_per_rank) -> str:
    if not callable(bytes_per_rank):
        raise Wrong("pass your function itself: `q2.check(bytes_per_rank)`")
    for num_params, ranks in ((1_000_000, 4), (124_000_000, 8), (7_000_000_000, 64), (10_000, 1)):
        for strategy in STRATEGIES:
            got = bytes_per_rank(num_params, ranks, strategy)
            case = f"{strategy}, {num_params:,} parameters on {ranks} ranks"
            if not isinstance(got, dict) or set(got) != set(_BYTES_PER_PARAMETER):
                raise Wrong(f"{case}: return a dict with the keys 'parameters', 'gradients' and 'optimizer', "
                            f"got {got!r}")
            expected = expected_bytes(num_params, ranks, strategy)
            for part, value in expected.items():
                if not math.isclose(float(got[part]), value, rel_tol=1e-3):  # room for rounding up a shard
                    raise Wrong(f"{case}: {part} should take {value:,.0f} bytes per rank, got {float(got[part]):,.0f}."
                                + _why(part, float(got[part]), value, num_params, ranks, strategy))
    return ("your bytes per rank match the ZeRO accounting: DDP holds 16 bytes per parameter on every rank, FSDP "
            "16/N; a 7 B-parameter model needs 112 GB per GPU under DDP and 1.75 GB on 64 GPUs with FSDP.")


def _why(part, got, expected, num_params, ranks, strategy) -> str:
    sharded = part in _SHARDED[strategy]
    if part == "optimizer" and math.isclose(got * 2, expected, rel_tol=1e-3):
        return " AdamW keeps two float32 moments per parameter (exp_avg and exp_avg_sq): 8 bytes."
    if ranks > 1 and not sharded and math.isclose(got * ranks, expected, rel_tol=1e-3):
        return f" {strategy} does not shard the {part}: every rank holds all of them."
    if ranks > 1 and sharded and math.isclose(got, expected * ranks, rel_tol=1e-3):
        return f" {strategy} shards the {part}: each of the {ranks} ranks holds 1/{ranks} of them."
    return f" ({_BYTES_PER_PARAMETER[part]} bytes per parameter" + (f", divided over {ranks} ranks)." if sharded else ").")


# ----- q3: gradient accumulation with no_sync(), run on real ranks ----------------------------------

MICRO_BATCHES, PER_MICRO_BATCH = 4, 3
TIME_LIMIT = 300  # seconds the two-rank run of a check may take (two Python processes start: ~10 s on 2 cores)


def accumulation_report(accumulate) -> dict:
    """Run ``accumulate(model, micro_batches)`` on this rank of the default process group; what it did.

    The model is a DDP-wrapped float64 MLP with small buckets; ``micro_batches`` is this rank's shard of a global
    batch, split in MICRO_BATCHES. The report compares the gradients with one process's on the whole global
    batch and counts the bucket all-reduces, against those of one ordinary backward pass.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    total = world * MICRO_BATCHES * PER_MICRO_BATCH
    x = torch.randn(total, 12, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (total,), generator=gen)

    single = WideMLP(in_features=12, width=16, depth=2, seed=3).double()
    F.cross_entropy(single(x), y).backward()
    reference = [p.grad for p in single.parameters()]

    model = DDP(WideMLP(in_features=12, width=16, depth=2, seed=3).double(), bucket_cap_mb=0.001)
    state = {"all_reduces": 0}
    model.register_comm_hook(state, _counting_allreduce)
    shard = slice(rank * total // world, (rank + 1) * total // world)
    mine_x, mine_y = x[shard], y[shard]
    for _ in range(2):  # the first backward passes build DDP's buckets; then one ordinary step, counted
        state["all_reduces"] = 0
        F.cross_entropy(model(mine_x), mine_y).backward()
        model.zero_grad(set_to_none=True)
    buckets = state["all_reduces"]

    weights = [p.detach().clone() for p in model.parameters()]
    state["all_reduces"] = 0
    accumulate(model, list(zip(mine_x.chunk(MICRO_BATCHES), mine_y.chunk(MICRO_BATCHES))))
    grads = [p.grad for p in model.parameters()]
    report = {"rank": rank, "world": world, "buckets": buckets, "all_reduces": state["all_reduces"],
              "weights_changed": any(not torch.equal(w, p) for w, p in zip(weights, model.parameters())),
              "missing_gradients": any(g is None for g in grads)}
    if not report["missing_gradients"]:
        flat, ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in reference])
        report["difference"] = ((flat - ref).abs().max() / ref.abs().max()).item()
        report["scale"] = (flat @ ref / (ref @ ref)).item()  # how many times the right gradients, at best fit
    return report


def _counting_allreduce(state, bucket):
    state["all_reduces"] += 1
    return allreduce_hook(None, bucket)


def _judge(report: dict) -> None:
    """Raise Wrong unless the rank's report shows the right gradients from one all-reduce per bucket."""
    where = f"(on {report['world']} rank{'s' if report['world'] > 1 else ''})"
    if report["weights_changed"]:
        raise Wrong(f"{where} the weights changed: only accumulate the gradients, the caller calls optimizer.step()")
    if report["missing_gradients"]:
        raise Wrong(f"{where} some parameters have no gradient: call backward() for every micro-batch")
    calls, buckets, k = report["all_reduces"], report["buckets"], MICRO_BATCHES
    if calls == 0:
        raise Wrong(f"{where} the gradients were never all-reduced: the last micro-batch's backward() must run "
                    "outside no_sync(), or every rank keeps only its own gradients")
    if calls >= k * buckets:
        raise Wrong(f"{where} {calls} bucket all-reduces for one optimizer step, {k}× the {buckets} of one backward "
                    "pass: run every backward() but the last inside `with model.no_sync():`")
    if calls != buckets:
        raise Wrong(f"{where} {calls} bucket all-reduces for one optimizer step; one backward pass makes {buckets}: "
                    "only the last micro-batch's backward() should run outside no_sync()")
    if report["difference"] > 1e-9:
        scale = report["scale"]
        if math.isclose(scale, k, rel_tol=1e-6):
            raise Wrong(f"{where} the gradients are {k}× too large: backward() adds up, so divide each micro-batch's "
                        f"loss by the number of micro-batches ({k})")
        if report["world"] > 1 and math.isclose(scale, 1 / report["world"], rel_tol=1e-6):
            raise Wrong(f"{where} the gradients are {report['world']}× too small: DDP already averages over the ranks, "
                        "do not divide the loss by the world size")
        raise Wrong(f"{where} the gradients differ from one process's on the whole batch (by {report['difference']:.1e}"
                    " of the largest): backward() every micro-batch's loss / number of micro-batches, without "
                    "clearing .grad in between")


def _check_accumulation(accumulate) -> str:
    if not callable(accumulate):
        raise Wrong("pass your function itself: `q3.check(accumulate)`")
    if not dist.is_initialized():  # one rank, in this process: quick, and most mistakes show already
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            _judge(accumulation_report(accumulate))
        finally:
            gc.collect()  # free the DDP model (its hooks make cycles) before its process group goes
            dist.destroy_process_group()
    _judge_two_ranks(accumulate)
    return (f"{MICRO_BATCHES} micro-batches, one all-reduce per bucket, and on two gloo ranks the gradients equal one "
            "process's on the whole batch.")


def _judge_two_ranks(accumulate) -> None:
    """Write the function into a script, run it on two gloo ranks under torchrun, and judge both ranks' reports."""
    try:
        source = textwrap.dedent(inspect.getsource(accumulate))
    except (OSError, TypeError):
        raise Wrong("the check runs your function in two new processes and needs its source: define it with "
                    "`def` in a cell of its own") from None
    script = SCRIPT.format(source=source, name=accumulate.__name__)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "accumulate_on_two_ranks.py"
        path.write_text(script)
        run = distributed.torchrun(path, nproc=2, time_limit=TIME_LIMIT, echo=False,
                                   env={"CUDA_VISIBLE_DEVICES": ""})
    if not run.ok:
        raise Wrong(f"on two ranks, {run.failure()}")
    reports = run.results(rank=None)
    if len(reports) != 2:
        raise Wrong(f"on two ranks, expected a report from each rank, got {len(reports)}")
    for report in reports:
        _judge(report)


SCRIPT = """\
import gc
import json
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gpulab.questions.lesson07 import accumulation_report

{source}

dist.init_process_group("gloo")
try:
    print("RESULT", json.dumps(accumulation_report({name})), flush=True)
    gc.collect()  # free the DDP model (its hooks make cycles) while its process group still exists
    dist.barrier()  # and tear the group down on no rank before every rank is done: else a rank aborts
finally:
    dist.destroy_process_group()
"""

q1 = Question(
    lesson="07", number=1, title="bus bandwidth from a timing",
    checker=_check_bus_bandwidth,
    hint_text="The algorithm bandwidth is `nbytes / seconds`. nccl-tests multiplies it by 2(n−1)/n for all_reduce "
              "and by (n−1)/n for all_gather and reduce_scatter. Divide by 1e9 for GB/s.",
    solution_text="""
def bus_bandwidth_gbs(op, nbytes, seconds, ranks):
    factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
    return nbytes / seconds * factor / 1e9
""",
)

q2 = Question(
    lesson="07", number=2, title="bytes per rank: DDP, ZeRO, FSDP",
    checker=_check_bytes,
    hint_text="Per parameter: 4 bytes of weights, 4 of gradient, 8 of AdamW state (two moments). DDP shards nothing; "
              "ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, FSDP (ZeRO-3) also the parameters. "
              "A sharded part is divided by the number of ranks.",
    solution_text="""
def bytes_per_rank(num_params, ranks, strategy):
    sharded = {"DDP": [], "ZeRO-1": ["optimizer"], "ZeRO-2": ["gradients", "optimizer"],
               "FSDP": ["parameters", "gradients", "optimizer"]}[strategy]
    per_parameter = {"parameters": 4, "gradients": 4, "optimizer": 8}
    return {part: size * num_params / (ranks if part in sharded else 1) for part, size in per_parameter.items()}
""",
)

q3 = Question(
    lesson="07", number=3, title="accumulate with no_sync()",
    checker=_check_accumulation,
    hint_text="Loop over the micro-batches with their index. Every micro-batch but the last: "
              "`with model.no_sync(): (F.cross_entropy(model(x), y) / len(micro_batches)).backward()`. "
              "The last one: the same line outside no_sync(), so that its backward all-reduces the sum.",
    solution_text="""
def accumulate(model, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
""",
)
