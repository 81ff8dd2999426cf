"""Lesson 07, more than one GPU: bus bandwidth from a timing, bytes per rank under DDP, ZeRO and FSDP, and
gradient accumulation with no_sync() (run on two gloo ranks by the check).

Each expected value is computed only once the learner's function has returned: an answer that looks through its
callers' frames finds none. The ranks of q3 report what the function did; this process compares it with a
reference of its own."""

import gc
import inspect
import math
import tempfile
import textwrap
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import distributed
from ..check import Question, Wrong
from ..models import WideMLP


def _is_number(value) -> bool:
    """An int, a float or a number that converts to one (numpy's, a 0-d tensor), not a bool."""
    return not isinstance(value, bool) and (isinstance(value, (int, float)) or hasattr(value, "__float__"))


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
    answers = [bus_bandwidth_gbs(*case) for case in _BANDWIDTH_CASES]  # before any expected value exists
    for (op, nbytes, seconds, ranks), got in zip(_BANDWIDTH_CASES, answers):
        if not _is_number(got):
            raise Wrong(f"bus_bandwidth_gbs({op!r}, ...) should return a number of GB/s, got {type(got).__name__}")
        got, algbw = float(got), nbytes / seconds / 1e9
        expected = distributed.bus_bandwidth(op, nbytes, seconds, ranks) / 1e9
        if math.isclose(got, expected, rel_tol=1e-6):
            continue
        case = f"{op} of {nbytes:.4g} bytes in {seconds:g} s on {ranks} ranks"
        if math.isclose(got, algbw, rel_tol=1e-6):
            raise Wrong(f"{case}: {got:.4g} GB/s is the algorithm bandwidth (bytes / time); the bus bandwidth "
                        "multiplies it by what each rank's link carries in a ring, nccl-tests' factor")
        for factor, why in ((8, "GB/s counts bytes, not bits"), (1e9, "that is bytes/s: divide by 10⁹ for GB/s"),
                            (1e9 / 2**30, "a GB is 10⁹ bytes here, as in nccl-tests, not 2³⁰")):
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
_BYTES_CASES = ((1_000_000, 4), (124_000_000, 8), (7_000_000_000, 64), (10_000, 1))  # (parameters, ranks)


def expected_bytes(num_params: int, ranks: int, strategy: str) -> dict:
    """What one rank holds, in bytes, training in float32 with AdamW (the ZeRO paper's accounting)."""
    return {part: size * num_params / (ranks if part in _SHARDED[strategy] else 1)
            for part, size in _BYTES_PER_PARAMETER.items()}


def _check_bytes(bytes_per_rank) -> str:
    if not callable(bytes_per_rank):
        raise Wrong("pass your function itself: `q2.check(bytes_per_rank)`")
    cases = [(num_params, ranks, strategy) for num_params, ranks in _BYTES_CASES for strategy in STRATEGIES]
    answers = [bytes_per_rank(*case) for case in cases]  # before any expected value exists
    for (num_params, ranks, strategy), got in zip(cases, answers):
        case = f"{strategy}, {num_params:,} parameters on {ranks} ranks"
        if not isinstance(got, dict) or set(got) != set(_BYTES_PER_PARAMETER):
            raise Wrong(f"{case}: return a dict with the keys 'parameters', 'gradients' and 'optimizer', got {got!r}")
        for part, value in expected_bytes(num_params, ranks, strategy).items():
            if not _is_number(got[part]):
                raise Wrong(f"{case}: {part} should be a number of bytes, got {got[part]!r}")
            if not math.isclose(float(got[part]), value, rel_tol=1e-3):  # room for rounding up a shard
                raise Wrong(f"{case}: {part} should take {value:,.0f} bytes per rank, got {float(got[part]):,.0f}."
                            + _why(part, float(got[part]), value, ranks, strategy))
    return ("your bytes per rank match the ZeRO accounting: DDP holds 16 bytes per parameter on every rank, FSDP "
            "16/N; a 7 B-parameter model needs 112 GB per GPU under DDP and 1.75 GB on 64 GPUs with FSDP.")


def _why(part, got, expected, ranks, strategy) -> str:
    """The likely mistake behind ``got`` bytes of ``part`` where ``expected`` were right, or the rule."""
    sharded = part in _SHARDED[strategy]
    close = lambda factor: math.isclose(got * factor, expected, rel_tol=1e-3)
    if close(1e9) or close(2**30):
        return " Return bytes, not GB."
    if part == "optimizer" and close(2):
        return " AdamW keeps two float32 moments per parameter (exp_avg and exp_avg_sq): 8 bytes."
    if part == "optimizer" and close(2 / 3):
        return (" AdamW's state is its two float32 moments, 8 bytes; the ZeRO paper's 12 also counts the float32 "
                "master weights that mixed-precision training keeps.")
    if part != "optimizer" and close(2):
        return (f" In float32 training the {part} take 4 bytes each; 2 is fp16 or bf16 (the ZeRO paper's 2 + 2 + 12 "
                "bytes per parameter is mixed precision).")
    if ranks > 1 and not sharded and close(ranks):
        return f" {strategy} does not shard the {part}: every rank holds all of them."
    if ranks > 1 and sharded and close(1 / ranks):
        return f" {strategy} shards the {part}: each of the {ranks} ranks holds 1/{ranks} of them."
    return f" ({_BYTES_PER_PARAMETER[part]} bytes per parameter" + (f", divided over {ranks} ranks)." if sharded else ").")


# ----- q3: gradient accumulation with no_sync(), run on real ranks ----------------------------------

MICRO_BATCHES, PER_MICRO_BATCH = 4, 3
TIME_LIMIT = 300  # seconds the two-rank run of a check may take (two Python processes start: ~10 s on 2 cores)


def _global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one optimizer step over ``world`` ranks: MICRO_BATCHES × PER_MICRO_BATCH per rank."""
    gen = torch.Generator().manual_seed(7)
    total = world * MICRO_BATCHES * PER_MICRO_BATCH
    return torch.randn(total, 12, generator=gen, dtype=torch.float64), torch.randint(0, 10, (total,), generator=gen)


def _model() -> torch.nn.Module:
    return WideMLP(in_features=12, width=16, depth=2, seed=3).double()


def _shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples of the global batch, as copies: nothing in this rank holds the others'."""
    x, y = _global_batch(world)
    mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    return x[mine].clone(), y[mine].clone()


def _reference_gradients(world: int) -> torch.Tensor:
    """One process's gradients on the whole global batch, flattened: what every rank's should equal."""
    x, y = _global_batch(world)
    model = _model()
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def accumulation_report(accumulate) -> dict:
    """Run ``accumulate(model, micro_batches)`` on this rank of the default process group; what it did.

    The model is a DDP-wrapped float64 MLP with small buckets; ``micro_batches`` is this rank's shard of the global
    batch, split in MICRO_BATCHES. The report holds the gradients, the forward passes with their batch sizes and
    the backward passes in order, and the bytes all-reduced, against those of one ordinary backward pass. No
    reference exists in this process: the caller compares the gradients with its own, computed afterwards.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _shard(rank, world)
    model = DDP(_model(), bucket_cap_mb=0.001)
    model.register_comm_hook(None, _bucket_all_reduce)
    state = {"all_reduced": 0}
    with _counting_all_reduces(state):
        for _ in range(2):  # the first backward builds DDP's buckets; the second, an ordinary one, is counted
            state["all_reduced"] = 0
            F.cross_entropy(model(x), y).backward()
            model.zero_grad(set_to_none=True)
        per_backward = state["all_reduced"]
        weights = [p.detach().clone() for p in model.parameters()]
        state["all_reduced"], forwards, passes = 0, [], []
        model.module.register_forward_hook(_recording(forwards, passes))
        accumulate(model, list(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))))
    grads = [p.grad for p in model.parameters()]
    return {"rank": rank, "world": world, "forwards": forwards, "passes": "".join(passes),
            "all_reduced": state["all_reduced"], "per_backward": per_backward,
            "weights_changed": any(not torch.equal(w, p) for w, p in zip(weights, model.parameters())),
            "gradients": None if any(g is None for g in grads) else torch.cat([g.flatten() for g in grads]).tolist()}


def _bucket_all_reduce(state, bucket):
    """DDP's all-reduce of a bucket, averaged over the ranks (torch's allreduce_hook), through
    ``dist.all_reduce`` so that it is counted with the learner's own."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


@contextmanager
def _counting_all_reduces(state: dict):
    """Within the block, ``torch.distributed.all_reduce`` adds the bytes it reduces to ``state["all_reduced"]``."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        state["all_reduced"] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


def _recording(forwards: list, passes: list):
    """A forward hook: each forward's batch size, and "F" then "B" in ``passes`` when its backward reaches it."""
    def hook(module, args, output):
        forwards.append(len(args[0]))
        passes.append("F")
        if output.requires_grad:
            output.register_hook(lambda grad: passes.append("B"))
    return hook


def _judge(report: dict, reference: torch.Tensor) -> None:
    """Raise Wrong unless the rank ran each micro-batch forward and backward in turn, all-reduced the gradients
    once, and ended with ``reference``."""
    where = f"(on {report['world']} rank{'s' if report['world'] > 1 else ''})"
    if report["weights_changed"]:
        raise Wrong(f"{where} the weights changed: only accumulate the gradients, the caller calls optimizer.step()")
    if report["gradients"] is None:
        raise Wrong(f"{where} some parameters have no gradient: call backward() for every micro-batch")
    _judge_passes(report["forwards"], report["passes"], where)
    _judge_all_reduced(report["all_reduced"], report["per_backward"], where)
    _judge_gradients(torch.tensor(report["gradients"], dtype=torch.float64), reference, report["world"], where)


def _judge_passes(forwards: list[int], passes: str, where: str) -> None:
    k, n = MICRO_BATCHES, PER_MICRO_BATCH
    if forwards == [k * n]:
        raise Wrong(f"{where} one forward pass on all {k * n} samples: that is one large batch, not accumulation. Run "
                    f"each micro-batch ({n} samples) forward and backward in turn, so that only one micro-batch's "
                    "activations are alive at a time")
    if forwards != [n] * k:
        raise Wrong(f"{where} forward passes on batches of {forwards} samples: run each of the {k} micro-batches "
                    f"({n} samples) forward once")
    if passes.count("B") != k:
        raise Wrong(f"{where} {passes.count('B')} backward passes reached the model's outputs for {k} forwards: call "
                    "backward() once on each micro-batch's loss")
    waiting = max(passes[:i].count("F") - passes[:i].count("B") for i in range(len(passes) + 1))
    if waiting > 1:
        raise Wrong(f"{where} the forwards of {waiting} micro-batches ran before their backward passes (a sum of their "
                    "losses, backpropagated once?): their activations were alive together, as in one large batch. "
                    "Call backward() on each micro-batch's loss right after its forward")


def _judge_all_reduced(nbytes: int, per_backward: int, where: str) -> None:
    k, times = MICRO_BATCHES, nbytes / per_backward  # how many times the gradients were all-reduced
    if nbytes == 0:
        raise Wrong(f"{where} the gradients were never all-reduced: the last micro-batch's backward() must run "
                    "outside no_sync(), or every rank keeps only its own gradients")
    if times >= k:
        raise Wrong(f"{where} the gradients were all-reduced {times:g} times for one optimizer step, once per "
                    "micro-batch: run every backward() but the last inside `with model.no_sync():`")
    if not math.isclose(times, 1, rel_tol=1e-6):
        raise Wrong(f"{where} {times:.3g}× the gradients' bytes were all-reduced for one optimizer step; once is "
                    "enough: only the last micro-batch's backward() should run outside no_sync()")


def _judge_gradients(grads: torch.Tensor, reference: torch.Tensor, world: int, where: str) -> None:
    k = MICRO_BATCHES
    difference = ((grads - reference).abs().max() / reference.abs().max()).item()
    if difference <= 1e-9:
        return
    scale = (grads @ reference / (reference @ reference)).item()  # how many times the right gradients, at best fit
    if math.isclose(scale, k, rel_tol=1e-6):
        raise Wrong(f"{where} the gradients are {k}× too large: backward() adds up, so divide each micro-batch's "
                    f"loss by the number of micro-batches ({k})")
    if world > 1 and math.isclose(scale, 1 / world, rel_tol=1e-6):
        raise Wrong(f"{where} the gradients are {world}× too small: DDP already averages over the ranks, "
                    "do not divide the loss by the world size")
    if world > 1 and math.isclose(scale, world, rel_tol=1e-6):
        raise Wrong(f"{where} the gradients are {world}× too large: all_reduce sums over the ranks, so divide by "
                    "the world size (DDP's own all-reduce averages)")
    raise Wrong(f"{where} the gradients differ from one process's on the whole batch (by {difference:.1e} of the "
                "largest): backward() every micro-batch's loss / number of micro-batches, without clearing .grad "
                "in between")


def _check_accumulation(accumulate) -> str:
    if not callable(accumulate):
        raise Wrong("pass your function itself: `q3.check(accumulate)`")
    if not dist.is_initialized():  # one rank, in this process: quick, and most mistakes show already
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            report = accumulation_report(accumulate)
        finally:
            gc.collect()  # free the DDP model (its hooks make cycles) before its process group goes
            dist.destroy_process_group()
        _judge(report, _reference_gradients(world=1))
    reports = _two_rank_reports(accumulate)
    reference = _reference_gradients(world=2)  # only now: the ranks have finished
    for report in reports:
        _judge(report, reference)
    return (f"{MICRO_BATCHES} micro-batches, each forward then backward, the gradients all-reduced once, and on two "
            "gloo ranks they equal one process's on the whole batch.")


def _two_rank_reports(accumulate) -> list[dict]:
    """Write the function into a script, run it on two gloo ranks under torchrun: both ranks' reports."""
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
    return reports


SCRIPT = """\
import contextlib
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
