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


class SpeedrunNet(nn.Module):
    """A CIFAR-10 speedrun network (the kind airbench and Keller Jordan's runs train to 94 % in seconds) for
    3×32×32 images: a convolution at full resolution, then three blocks of (convolution, 2×2 max-pool, BatchNorm,
    GELU, convolution, BatchNorm, GELU) at 32→16, 16→8 and 8→4, global max-pooling and a linear classifier.

    ``widths`` are the stem's channels and each block's: (64, 256, 512, 1024) gives about 2.4 GFLOP per image
    forward, enough that a GPU's matrix units, not Python, set the pace; (4, 8, 16, 32) trains on a laptop CPU.
    """

    def __init__(self, widths: tuple[int, ...] = (64, 256, 512, 1024), num_classes: int = 10, seed: int = 0):
        super().__init__()
        stem, *blocks = widths
        with seeded(seed):
            layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, padding=1, bias=False), nn.BatchNorm2d(stem), nn.GELU()]
            for c_in, c_out in zip([stem, *blocks], blocks):
                layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(c_out),
                           nn.GELU(), nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.GELU()]
            layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(blocks[-1], num_classes, bias=False)]
            self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


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


class TutorialCNN(nn.Module):
    """The small CNN of PyTorch's CIFAR-10 tutorial, for 3×32×32 images: (5×5 convolution, activation,
    2×2 max-pool) twice, then three fully connected layers.

    ``width`` multiplies every layer (1: the tutorial's 6 and 16 channels, 120 and 84 hidden units);
    ``activation`` is the non-linearity's class (``nn.ReLU``, ``nn.GELU``, ``nn.SiLU``, ...).
    """

    def __init__(self, num_classes: int = 10, width: int = 1, activation: type[nn.Module] = nn.ReLU, seed: int = 0):
        super().__init__()
        c1, c2, h1, h2 = 6 * width, 16 * width, 120 * width, 84 * width
        with seeded(seed):
            self.net = nn.Sequential(
                nn.Conv2d(3, c1, 5), activation(), nn.MaxPool2d(2),
                nn.Conv2d(c1, c2, 5), activation(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(c2 * 5 * 5, h1), activation(),
                nn.Linear(h1, h2), activation(), nn.Linear(h2, num_classes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ResidualMLP(nn.Module):
    """``depth`` residual blocks as in a transformer's feed-forward layers: activation memory grows with the
    depth and the batch, and ``blocks`` (an ``nn.Sequential``) can be checkpointed a segment at a time.

    Flattens its input like WideMLP (``in_features=3*32*32`` for images), embeds it in ``width`` features,
    runs the blocks, and classifies.
    """

    def __init__(self, in_features: int = 3 * 32 * 32, width: int = 256, depth: int = 8, num_classes: int = 10,
                 seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.embed = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width))
            self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
            self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


class ResidualBlock(nn.Module):
    """``x + Linear(GELU(Linear(LayerNorm(x))))``, the hidden layer four times as wide as ``x``."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)
