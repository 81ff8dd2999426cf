"""Access to NVML (the library behind nvidia-smi) through nvidia-ml-py, degrading to a reason."""

from contextlib import contextmanager

import torch


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message says why."""


@contextmanager
def session():
    """Initialise NVML for the duration of a ``with`` block; raises NvmlUnavailable with the reason."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable(
            "the 'pynvml' module is missing: pip install nvidia-ml-py"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML could not start ({err}): no NVIDIA driver on this machine?") from None
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def available() -> tuple[bool, str]:
    """(True, driver version) when NVML works, else (False, the reason)."""
    try:
        with session() as nv:
            return True, _text(nv.nvmlSystemGetDriverVersion())
    except NvmlUnavailable as err:
        return False, str(err)


def handle_for(nv, index: int = 0):
    """The NVML handle of torch's CUDA device ``index`` (matched by PCI bus id, as
    CUDA_VISIBLE_DEVICES may renumber devices)."""
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            pci = f"{props.pci_domain_id:08x}:{bus:02x}:{props.pci_device_id:02x}.0"
            try:
                return nv.nvmlDeviceGetHandleByPciBusId(pci.encode())
            except nv.NVMLError:
                pass
    return nv.nvmlDeviceGetHandleByIndex(index)


def query(nv, fn, *args, default=None):
    """Call an NVML query, returning ``default`` where this GPU or driver does not support it."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return default


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
