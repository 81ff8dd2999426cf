"""The few small models the lessons share. Each is built the same way every time from its ``seed``,
without disturbing the global random stream."""

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def seeded(seed: int):
    """Inside the block torch's CPU random stream starts from ``seed``; afterwards it is as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class SmallCNN(nn.Module):
    """A small VGG-style CNN for 3×32×32 images: many activations per sample, few weights.

    Convolutions with BatchNorm and ReLU at 32×32, 16×16 and 8×8, then global pooling and a linear
    classifier. ``width`` is the number of channels of the first layers (doubled twice on the way down).
    """

    def __init__(self, num_classes: int = 10, width: int = 32, seed: int = 0):
        super().__init__()
        w = width
        with seeded(seed):
            self.net = nn.Sequential(
                _conv_bn_relu(3, w), _conv_bn_relu(w, w), nn.MaxPool2d(2),
                _conv_bn_relu(w, 2 * w), nn.MaxPool2d(2),
                _conv_bn_relu(2 * w, 4 * w), nn.MaxPool2d(2),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class WideMLP(nn.Module):
    """A wide multi-layer perceptron: a few large matrix multiplies, memory dominated by the weights.

    Flattens its input, so it takes the same 3×32×32 images as SmallCNN (``in_features=3*32*32``)
    or plain feature vectors.
    """

    def __init__(self, in_features: int = 3 * 32 * 32, width: int = 4096, depth: int = 3,
                 num_classes: int = 10, seed: int = 0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        with seeded(seed):
            for i in range(depth):
                layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU()]
            layers.append(nn.Linear(width if depth else in_features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
