"""Learnable tasks that need nothing downloaded, and the small model the lessons train on them.

The teacher task labels Gaussian points with a fixed random "teacher" network, so the right answer is
known: a big enough student can reach 100% test accuracy, and chance is about 1 / classes.
"""

from dataclasses import dataclass

import torch
from torch import nn


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
