"""Measuring host↔device copies: a bandwidth sweep over sizes, and a timeline of CUDA streams.

The copies themselves are written in the notebook: ``sweep`` receives, for each direction, a
function ``make(nbytes, pinned)`` that allocates its buffers (outside the timed region) and returns
the copy to time. ``sweep`` only warms up, times (``gpulab.bench``: synchronised, repeated),
records and tabulates.
"""

import math
import time
from contextlib import contextmanager

import pandas as pd
import torch
from tqdm.auto import tqdm

from .device import on_gpu
from .timing import bench

KiB, MiB, GiB = 2**10, 2**20, 2**30  # sizes are binary multiples; rates are SI (1 GB/s = 1e9 bytes/s)
MEMORIES = ("pageable", "pinned")


def sizes(smallest: int = 4 * KiB, largest: int = GiB, factor: int = 4) -> list[int]:
    """Transfer sizes in bytes from ``smallest`` to ``largest``, each ``factor`` times the previous."""
    if not 0 < smallest <= largest or factor < 2:
        raise ValueError(f"need 0 < smallest <= largest and factor >= 2, got {smallest}, {largest}, {factor}")
    out = [smallest]
    while out[-1] * factor <= largest:
        out.append(out[-1] * factor)
    return out


def human_bytes(nbytes: float) -> str:
    """4096 → '4 KiB', 2**30 → '1 GiB': binary multiples, written as such."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def sweep(copies: dict, nbytes: list[int], *, memories=MEMORIES, device=None, log=None,
          min_time: float = 0.2, **fields) -> pd.DataFrame:
    """Bandwidth of every copy in ``copies`` ({direction: make}) at every size and kind of host memory.

    ``make(nbytes, pinned)`` allocates (untimed) and returns the copy, a function of no arguments.
    Each point is recorded in ``log`` (a ``gpulab.ResultLog``) as soon as it is measured, with ``fields``
    (extra columns, e.g. ``link_gbps=...``).
    Returns one row per point: direction, memory, nbytes, gbps (1 GB/s = 1e9 bytes/s), median_s, iqr_s.
    """
    points = [(d, m, n) for d in copies for m in memories for n in nbytes]
    rows = []
    for direction, memory, size in tqdm(points, desc="transfer sweep"):
        copy = copies[direction](size, memory == "pinned")
        measurement = bench(copy, label=f"{direction} {memory} {human_bytes(size)}", min_time=min_time,
                            device=device)
        del copy  # free the buffers before the next, possibly larger, point
        row = {"direction": direction, "memory": memory, "nbytes": size, "gbps": measurement.rate(size) / 1e9,
               **fields}
        if log is not None:
            log.add_measurement(measurement, **row)
        rows.append({**row, "median_s": measurement.median, "iqr_s": measurement.iqr})
    return pd.DataFrame(rows)


def summary(frame: pd.DataFrame, link_gbps: float | None = None) -> pd.DataFrame:
    """Bandwidth at the largest size of each direction and memory, and its fraction of the link."""
    largest = frame.loc[frame.groupby(["direction", "memory"], sort=False)["nbytes"].idxmax()]
    table = largest[["direction", "memory", "nbytes", "gbps"]].reset_index(drop=True)
    table["size"] = table["nbytes"].map(human_bytes)
    table["of_link"] = table["gbps"] / link_gbps if link_gbps else math.nan
    return table[["direction", "memory", "size", "gbps", "of_link"]]


class Timeline:
    """Spans of work, to draw which stream ran what, when.

        tl = Timeline(device)
        with torch.cuda.stream(copy_stream), tl.span("copy stream", "copy"):
            x = batch.to(device, non_blocking=True)
        tl.frame()   # lane, kind, start_ms, end_ms (after the GPU has finished)

    On a GPU a span's ends are CUDA events, recorded on the stream that is current when it opens and closes: the GPU
    times them, so they show what really ran concurrently. On a CPU they are readings of the host's clock (a CPU runs
    each operation as it is called).
    """

    def __init__(self, device=None):
        self.on_gpu = on_gpu(device)
        self._spans: list[tuple[str, str, object, object]] = []

    @contextmanager
    def span(self, lane: str, kind: str):
        start = self._now()
        yield
        self._spans.append((lane, kind, start, self._now()))

    def _now(self):
        """An event on the current stream (the GPU reads its clock when it gets there), or the host's clock."""
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def frame(self) -> pd.DataFrame:
        """One row per span, times in ms from the earliest start (on a GPU, after it has finished them)."""
        columns = ["lane", "kind", "start_ms", "end_ms"]
        if not self._spans:
            return pd.DataFrame(columns=columns)
        origin = self._spans[0][2]
        if self.on_gpu:
            for *_, end in self._spans:  # wait for each span's own GPU (a bare synchronize() waits for the current one)
                end.synchronize()
            since = origin.elapsed_time
        else:
            since = lambda clock: (clock - origin) * 1e3  # noqa: E731
        frame = pd.DataFrame([(lane, kind, since(s), since(e)) for lane, kind, s, e in self._spans], columns=columns)
        frame[["start_ms", "end_ms"]] -= frame["start_ms"].min()
        return frame
