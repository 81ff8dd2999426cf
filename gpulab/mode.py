"""Quick mode: small sizes and few repetitions, for CPUs and CI.

Quick mode is on when there is no CUDA device, or when ``CI`` or ``GPULAB_QUICK`` is set.
``GPULAB_QUICK=0`` forces full mode (a full run on a GPU machine that sets ``CI``).
"""

import os

import torch

_OFF = {"0", "false", "no", "off"}


def quick_mode() -> bool:
    """True when lessons should use small sizes and few repetitions."""
    flag = os.environ.get("GPULAB_QUICK")
    if flag is not None and flag.strip() != "":
        return flag.strip().lower() not in _OFF
    return bool(os.environ.get("CI")) or not torch.cuda.is_available()


def by_mode(full, quick):
    """Pick ``quick`` in quick mode and ``full`` otherwise (sizes, repeat counts, ...)."""
    return quick if quick_mode() else full
