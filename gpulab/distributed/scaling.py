"""The scaling model: a DDP step is its compute time, plus DDP's own work, plus an all-reduce of the gradients over a
``Link`` (a flat ring) or a ``Topology`` (NVLink inside a node, a network between nodes), minus the part of it hidden
behind the backward pass. Its lines are estimates.
"""


import pandas as pd

from .collectives import TOPOLOGIES, Topology, _positive

# ----- the scaling model ------------------------------------------------------------------------------


def ddp_step_seconds(compute_s: float, grad_bytes: float, n: int, link, overlap: float = 0.0,
                     overhead_s: float = 0.0) -> float:
    """An estimate of one data-parallel training step on ``n`` GPUs: compute + DDP's own work + the all-reduce of
    the gradients over ``link`` (a ``Link``: one flat ring; a ``Topology``: nodes) − what of it is hidden.

    ``overlap`` is the fraction of the compute time the all-reduce can run alongside: 0 when it starts after
    the backward pass; DDP all-reduces each bucket as soon as its gradients are ready, so up to the backward
    pass's share of a step (about 2/3). ``overhead_s`` is DDP's own work per step (copying gradients into its
    buckets and back, hooks), measured on one rank as its step time less the same step inside ``no_sync()``.
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a fraction of the compute time, from 0 to 1; got {overlap}")
    compute_s = _positive("compute_s", compute_s, zero=True)
    overhead_s = _positive("overhead_s", overhead_s, zero=True)
    comm = link.allreduce_seconds(grad_bytes, n)
    return compute_s + overhead_s + comm - min(comm, overlap * compute_s)


def scaling_table(compute_s: float, grad_bytes: float, gpus, links=TOPOLOGIES, overlap: float = 0.0,
                  overhead_s: float = 0.0) -> pd.DataFrame:
    """Estimated step time, communication time, speed-up and scaling efficiency for each link or topology and GPU
    count (a topology's rows only for the counts it has: whole nodes, no more than one node without a network).

    Weak scaling, each GPU with the same batch: efficiency = step(1) / step(n), speed-up = n × efficiency.
    """
    rows = []
    for link in links:
        one = ddp_step_seconds(compute_s, grad_bytes, 1, link, overlap, overhead_s)
        for n in gpus:
            if isinstance(link, Topology) and not link.fits(n):
                continue
            step = ddp_step_seconds(compute_s, grad_bytes, n, link, overlap, overhead_s)
            rows.append({"link": link.name, "gpus": n, "compute_s": compute_s, "overhead_s": overhead_s,
                         "comm_s": link.allreduce_seconds(grad_bytes, n), "step_s": step,
                         "speedup": n * one / step, "efficiency": one / step, "overlap": overlap})
    return pd.DataFrame(rows)
