"""Collectives' bandwidth the way nccl-tests reports it (``bus_bandwidth``), the links and topologies the scaling
model knows, and ``fit_link``: a link's latency and bandwidth read off measured all-reduce times.
"""

import math
from dataclasses import dataclass

import numpy as np

# ----- collectives: algorithm and bus bandwidth, the way nccl-tests reports them ----------------------

BUS_FACTORS = {  # nccl-tests, doc/PERFORMANCE.md: bus bandwidth = algorithm bandwidth × factor(n)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _positive(name: str, value, *, zero: bool = False) -> float:
    """``value`` as a float, or a ValueError that names it: a finite number above 0 (or 0 with ``zero``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number; got {value!r}") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        raise ValueError(f"{name} must be a finite number {'of 0 or more' if zero else 'above 0'}; got {value!r}")
    return number


def _ranks(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n is the number of ranks, a whole number of 1 or more; got {n!r}")
    return int(n)


def bus_bandwidth(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bytes/s each rank's link carried: ``nbytes / seconds`` (the algorithm bandwidth) × nccl-tests' factor.

    ``nbytes`` is the size of the collective's largest buffer: the tensor for all_reduce and broadcast, the
    gathered output for all_gather, the input for reduce_scatter. It is comparable with the link's speed.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: use one of {', '.join(BUS_FACTORS)}")
    nbytes = _positive("nbytes", nbytes, zero=True)
    seconds = _positive("seconds (the time of one call)", seconds)
    return nbytes / seconds * BUS_FACTORS[op](_ranks(n))


@dataclass(frozen=True)
class Link:
    """A link between GPUs (or processes), as the scaling model sees it: every rank in one flat ring over it."""

    name: str
    bandwidth: float  # bytes/s each way, per GPU
    latency: float  # seconds per step of a ring
    source: str = ""  # where the figures come from

    def crossover_bytes(self, n: int) -> float:
        """The all-reduce size at which latency and bandwidth cost the same: below it, latency dominates."""
        return n * self.latency * self.bandwidth

    def allreduce_seconds(self, nbytes: float, n: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``n`` ranks on this link (``ring_allreduce_seconds``)."""
        return ring_allreduce_seconds(nbytes, n, self)

    def max_gpus(self) -> int | None:
        return None


# Nominal figures: bandwidth from the vendors' specifications; latency per ring step is an assumed order of
# magnitude (vendors do not publish it): it only matters for small gradients.
PCIE4 = Link("PCIe 4.0 x16", 31.5e9, 5e-6, "vendor spec: 16 GT/s × 16 lanes = 31.5 GB/s each way; latency assumed")
NVLINK4 = Link("NVLink 4 (H100 SXM)", 450e9, 5e-6,
               "vendor spec: 900 GB/s per GPU, both ways together; latency assumed")
INFINIBAND_NDR = Link("InfiniBand NDR, one 400 Gb/s port per GPU", 50e9, 10e-6,
                      "vendor spec: 400 Gb/s = 50 GB/s each way; latency assumed")
ETHERNET_100G_PER_8 = Link("100 Gb/s Ethernet, one port per node of 8 GPUs", 12.5e9 / 8, 30e-6,
                           "vendor spec: 100 Gb/s = 12.5 GB/s each way, shared by the node's 8 GPUs; latency "
                           "assumed (TCP sockets)")
VENDOR_LINKS = (PCIE4, NVLINK4, INFINIBAND_NDR)


@dataclass(frozen=True)
class Topology:
    """GPUs in nodes: ``gpus_per_node`` of them joined by ``intra`` (NVLink, PCIe), nodes joined by ``inter`` (each
    GPU's share of the network: one InfiniBand port per GPU, or a node's Ethernet shared by its GPUs); ``inter``
    None: one node only, and no more GPUs than it holds.

    An all-reduce across nodes is estimated hierarchically, the way NCCL's rings and trees avoid sending every
    byte over the slow link: a reduce-scatter inside each node, an all-reduce of each GPU's 1/``gpus_per_node``
    share between the nodes (every GPU over its own share of the network, at once), an all-gather inside each
    node. The reduce-scatter and the all-gather together cost a ring all-reduce inside the node.
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link | None = None
    source: str = ""

    def __post_init__(self):
        _ranks(self.gpus_per_node)

    def max_gpus(self) -> int | None:
        """The most GPUs this topology has: one node's without a network between nodes, else no limit."""
        return self.gpus_per_node if self.inter is None else None

    def fits(self, n: int) -> bool:
        """Whether ``n`` GPUs is a configuration of this topology: one node's or fewer, else whole nodes."""
        n = _ranks(n)
        if n <= self.gpus_per_node:
            return True
        return self.inter is not None and n % self.gpus_per_node == 0

    def allreduce_seconds(self, nbytes: float, n: int) -> float:
        """An all-reduce of ``nbytes`` over ``n`` GPUs: a ring inside one node, hierarchical across nodes."""
        n, g = _ranks(n), self.gpus_per_node
        if n <= g:
            return ring_allreduce_seconds(nbytes, n, self.intra)
        if self.inter is None:
            raise ValueError(f"{self.name}: one node of {g} GPUs and no network between nodes; {n} GPUs is not one "
                             "of its configurations")
        if n % g:
            raise ValueError(f"{self.name}: {n} GPUs is not a whole number of nodes of {g}")
        return ring_allreduce_seconds(nbytes, g, self.intra) + ring_allreduce_seconds(nbytes / g, n // g, self.inter)


TOPOLOGIES = (
    Topology("H100 SXM nodes: NVLink 4 inside 8, InfiniBand NDR between", 8, NVLINK4, INFINIBAND_NDR,
             "an H100 SXM NVLink domain is one node of 8 GPUs (DGX/HGX H100), one 400 Gb/s port per GPU"),
    Topology("PCIe 4.0 nodes of 8 GPUs, 100 Gb/s Ethernet between", 8, PCIE4, ETHERNET_100G_PER_8,
             "8 GPUs on PCIe 4.0 x16 without NVLink, one 100 Gb/s port per node"),
    Topology("a workstation: 4 GPUs on PCIe 4.0, no network", 4, PCIE4, None, "one machine, nothing between machines"),
)


def ring_allreduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n−1) steps, each sending nbytes/n over ``link``."""
    nbytes, n = _positive("nbytes", nbytes, zero=True), _ranks(n)
    if n < 2:
        return 0.0
    steps = 2 * (n - 1)
    return steps * link.latency + steps / n * nbytes / link.bandwidth


def fit_link(nbytes, seconds, n: int, name: str = "measured") -> Link:
    """The Link whose ring all-reduce times best match measured ones (least squares on relative error)."""
    try:
        nbytes, seconds = np.asarray(nbytes, float).ravel(), np.asarray(seconds, float).ravel()
    except (TypeError, ValueError):
        raise ValueError("fit_link needs numbers: message sizes in bytes and their times in seconds") from None
    n = _ranks(n)
    if len(nbytes) != len(seconds):
        raise ValueError(f"fit_link needs one time per message size; got {len(nbytes)} sizes and {len(seconds)} times")
    if n < 2 or len(nbytes) < 2:
        raise ValueError("fitting a link needs all-reduce times at two sizes or more, on two ranks or more")
    if not (np.isfinite(seconds).all() and (seconds > 0).all()):
        raise ValueError(f"every all-reduce time must be a finite number of seconds above 0; got {seconds.tolist()}")
    if not (np.isfinite(nbytes).all() and (nbytes > 0).all()) or len(set(nbytes.tolist())) < 2:
        raise ValueError("fit_link needs message sizes above 0 bytes, at least two different ones; got "
                         f"{nbytes.tolist()}")
    steps = 2 * (n - 1)
    design = np.column_stack([np.full_like(nbytes, steps), steps / n * nbytes]) / seconds[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if latency < 0:  # noise on a latency too small to see: refit the bandwidth alone
        latency, inverse_bandwidth = 0.0, float(np.sum(design[:, 1]) / np.sum(design[:, 1] ** 2))
    if inverse_bandwidth <= 0:
        raise ValueError("the all-reduce times do not grow with the message size, so no bandwidth can be read off "
                         "them: time larger messages (MiB and up), where the bytes cost more than the latency")
    return Link(name, 1 / inverse_bandwidth, float(latency), f"fitted to {len(nbytes)} all-reduce timings, {n} ranks")
