"""Quick mode: small sizes and few repetitions, for CPUs and CI.

Quick mode is on when the course's device is not a GPU (``gpulab.on_gpu``), or when ``CI`` or ``GPULAB_QUICK`` is set.
``GPULAB_QUICK=0`` forces full mode (a full run on a GPU machine that sets ``CI``).
"""

import os

from .device import on_gpu

_OFF = {"0", "false", "no", "off"}


def quick_mode() -> bool:
    """True when lessons should use small sizes and few repetitions."""
    flag = os.environ.get("GPULAB_QUICK")
    if flag is not None and flag.strip() != "":
        return flag.strip().lower() not in _OFF
    return bool(os.environ.get("CI")) or not on_gpu()


def by_mode(full, quick):
    """Pick ``quick`` in quick mode and ``full`` otherwise (sizes, repeat counts, ...)."""
    return quick if quick_mode() else full
