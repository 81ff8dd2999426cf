"""Learnable tasks that need nothing downloaded, the small model the lessons train on them, and the peak
memory of a training run measured from a clean state.

The teacher task labels Gaussian points with a fixed random "teacher" network, so the right answer is
known: a big enough student can reach 100% test accuracy, and chance is about 1 / classes.
"""

import gc
from dataclasses import dataclass

import torch
from torch import nn

from .device import get_device, on_gpu
from .memory import MemoryTracker


@dataclass
class TeacherTask:
    """A classification task: train and test sets on ``device``, labels from a random teacher network."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int

    @property
    def dim(self) -> int:
        return self.x_train.shape[1]

    def batches(self, batch_size: int, steps: int, seed: int = 0):
        """``steps`` random training batches (x, y), the same ones for the same seed on the same device."""
        g = torch.Generator(device=self.x_train.device).manual_seed(seed)
        for _ in range(steps):
            i = torch.randint(len(self.x_train), (batch_size,), device=self.x_train.device, generator=g)
            yield self.x_train[i], self.y_train[i]

    @torch.no_grad()
    def accuracy(self, model: nn.Module, batch_size: int = 8192) -> float:
        """Share of test points the model labels like the teacher (run it inside autocast to test in low precision)."""
        was_training = model.training
        model.eval()
        correct = sum((model(x).argmax(1) == y).sum() for x, y in zip(self.x_test.split(batch_size),
                                                                       self.y_test.split(batch_size)))
        model.train(was_training)
        return float(correct) / len(self.y_test)

    def chance(self) -> float:
        """Test accuracy of always answering the most common label: the baseline to beat."""
        return float(torch.bincount(self.y_test, minlength=self.classes).max()) / len(self.y_test)


def teacher_task(n_train: int, n_test: int = 10_000, *, dim: int = 32, classes: int = 10, hidden: int = 16,
                 seed: int = 0, device="cpu") -> TeacherTask:
    """Points x ~ N(0, I) in ``dim`` dimensions; label = argmax of a random tanh network's output.

    Generated on the CPU in fp32 with a fixed seed, so every device and precision sees the same data.
    """
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim, hidden, generator=g) * (2.0 / dim**0.5)
    w2 = torch.randn(hidden, classes, generator=g) / hidden**0.5
    x = torch.randn(n_train + n_test, dim, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    x, y = x.to(device), y.to(device)
    return TeacherTask(x[:n_train], y[:n_train], x[n_train:], y[n_train:], classes)


def student_mlp(dim: int, width: int, depth: int, classes: int) -> nn.Sequential:
    """An MLP: ``depth`` hidden layers of ``width`` (Linear → LayerNorm → GELU), then a linear classifier."""
    layers, inputs = [], dim
    for _ in range(depth):
        layers += [nn.Linear(inputs, width), nn.LayerNorm(width), nn.GELU()]
        inputs = width
    return nn.Sequential(*layers, nn.Linear(inputs, classes))


def training_peak_memory(start_run, step, *, steps: int = 2, device=None) -> int:
    """The most memory a fresh training run allocates on top of what was allocated before it, in bytes.

    ``start_run()`` builds everything one run needs (model, optimizer, scaler, ...) and returns it; ``step(run)``
    takes one training step. Measured from a clean state, so that the result does not depend on what ran before:
    a throw-away run takes one step first (one-time allocations of the process, such as cuBLAS's workspace, are
    made there and count for no run); then garbage is collected and the CUDA cache emptied, the baseline read, a
    fresh run built and stepped once (optimizers create their state at the first step), the peak statistics reset,
    and ``steps`` steps measured. The result holds the run's weights, gradients, optimizer state and activations.
    On a GPU it is the caching allocator's count; elsewhere a ``MemoryTracker`` counts the bytes of the tensors.
    """
    device = get_device(device)
    allocator = _CudaAllocator(device) if on_gpu(device) else _TrackedAllocator()
    with allocator:
        step(start_run())  # throw-away: one-time allocations happen here
        allocator.clean()
        base = allocator.allocated()
        run = start_run()
        step(run)  # warm-up: optimizer state, autotuning
        allocator.reset_peak()
        for _ in range(steps):
            step(run)
        return allocator.peak() - base


class _CudaAllocator:
    """PyTorch's caching-allocator statistics of one GPU, read after the queued work has finished."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def clean(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()


class _TrackedAllocator:
    """A MemoryTracker in the allocator's role: the bytes of the tensors created since it was entered."""

    def __init__(self):
        self.tracker = MemoryTracker()

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        return self.tracker.__exit__(*exc)

    def allocated(self) -> int:
        return self.tracker.current

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def peak(self) -> int:
        return self.tracker.peak

    def clean(self) -> None:
        gc.collect()
