"""What lesson 07's scripts use inside each rank besides torch: the plan's sizes from the command line, rank 0's result
rows, configurations timed in interleaved blocks that every rank starts together, DDP's all-reduces counted, how far
the ranks' tensors disagree, and the bytes a rank holds, counted from its tensors where no allocator measures them.

    args = script_args()                        # --device cpu|cuda and the plan's sizes
    times = timed({"a": step_a, "b": step_b}, args, device)
    report(part="scaling", times=times["a"])    # rank 0 prints RESULT {json}: Run.results() reads it
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..device import on_gpu
from .launch import RESULT
from .work import interleaved

PARTS = ("parameters", "buckets", "gradients", "optimizer")  # what a rank holds, as fsdp_bytes.py reports it


def script_args(argv=None) -> argparse.Namespace:
    """``--device`` (cpu: gloo; cuda: NCCL) and the sizes ``WorkSize.args()`` passes: width, batch, rounds, calls,
    max_bytes, iters."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    for name, default in (("width", 512), ("batch", 64), ("rounds", 8), ("calls", 2), ("max-bytes", 2**24),
                          ("iters", 100)):
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser.parse_args(argv)


def report(**row) -> None:
    """Rank 0 prints ``RESULT {json}``: one row of the launch's results."""
    if dist.get_rank() == 0:
        print(RESULT.strip(), json.dumps(row), flush=True)


def sync(device) -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU)."""
    if on_gpu(device):
        torch.cuda.synchronize(device)


_waiting = {}


def timed(fns: dict, args, device) -> dict:
    """Seconds per call of each function: ``args.rounds`` blocks of ``args.calls`` calls each, interleaved (A B, B A,
    ...: ``interleaved``), every rank starting each block together. The ranks of CUDA tensors meet on a gloo group: a
    wait on the CPU, with the GPUs idle."""
    if on_gpu(device) and "group" not in _waiting:
        _waiting["group"] = dist.new_group(backend="gloo")  # every rank makes it, at the same call
    group = _waiting.get("group") if on_gpu(device) else None
    return interleaved(fns, rounds=args.rounds, calls=args.calls, warmup=2, sync=lambda: sync(device),
                       before=lambda: dist.barrier(group=group))


class AllReduceCounter:
    """DDP's own all-reduce of each bucket (torch's ``allreduce_hook``), counted: a communication hook on ``model``."""

    def __init__(self, model, group=None):
        self.count, self.group = 0, group
        model.register_comm_hook(self, AllReduceCounter._hook)

    @staticmethod
    def _hook(state, bucket):
        state.count += 1
        return allreduce_hook(state.group, bucket)


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def disagreement(tensor: torch.Tensor) -> float:
    """The largest difference between any two ranks' values of ``tensor``, element by element (every rank calls it)."""
    high, low = tensor.clone(), tensor.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def measured_bytes(strategy: str, phases: list[int]) -> dict:
    """What the allocator gained in each phase of fsdp_bytes.py (``torch.cuda.memory_allocated()`` at the start, after
    the model, after wrapping it, after backward, after the optimizer's step): FSDP's parameters are its shards, kept
    when wrapping freed the full ones; DDP's wrapping adds its buckets."""
    start, model, wrapped, backward, stepped = phases
    fsdp = strategy == "FSDP"
    return dict(zip(PARTS, (((wrapped if fsdp else model) - start), 0 if fsdp else wrapped - model,
                            backward - wrapped, stepped - backward)), source="measured")


def counted_bytes(strategy: str, model, optimizer) -> dict:
    """The bytes of the tensors this rank holds (a CPU has no allocator statistics): of a sharded DTensor only its own
    shard; with ``gradient_as_bucket_view`` the gradients are views whose storages are DDP's buckets. Default DDP's
    buckets live inside its C++ reducer, where no count of tensors sees them: None."""
    grads = [p.grad for p in model.parameters()]
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]  # AdamW's exp_avg, exp_avg_sq
    buckets, gradients = (None if strategy == "DDP" else 0), _local_bytes(grads)
    if strategy == "DDP, gradient_as_bucket_view":
        buckets = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}.values())
        gradients = 0
    return dict(zip(PARTS, (_local_bytes(model.parameters()), buckets, gradients, _local_bytes(state))),
                source="counted")


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor  # here, not above: the scripts without FSDP start faster without it

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)
