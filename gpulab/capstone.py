"""The capstone's job: a CIFAR-shaped image classification task that needs no download, and the naive
training loop the graded exercise has to beat.

``make_dataset`` draws a learnable synthetic data set once, stored as uint8 arrays like decoded image files:
each class is a smooth random colour pattern, and each image is its class's pattern shifted, lit and
contrasted at random, with noise and a faint pattern of another class mixed in. ``AugmentedImages`` is the
per-sample CPU augmentation people write first. The speed-ups themselves are written out in lesson 08.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

# Per-channel mean and standard deviation of the pixels (over 0..1), measured on make_dataset(50_000, 0, seed=0),
# the seed the lesson and the check use; other seeds' patterns move them by up to about 0.05.
MEAN, STD = (0.499, 0.500, 0.499), (0.253, 0.260, 0.248)
MIX, NOISE = 0.7, 0.15  # the share of an image's own class pattern (the rest: another class's), pixel noise


@dataclass
class ImageData:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,), for training and for testing."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int = 10


def make_dataset(n_train: int, n_test: int, *, image_size: int = 32, num_classes: int = 10, seed: int = 0) -> ImageData:
    """A learnable data set of ``n_train`` + ``n_test`` images, the same for the same arguments on every machine."""
    gen = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.rand(num_classes, 3, 6, 6, generator=gen), size=image_size, mode="bicubic",
                              align_corners=False)  # one smooth colour pattern per class

    shifts = [(dy, dx) for dy in range(-4, 5) for dx in range(-4, 5)]
    own = MIX * torch.stack([templates.roll(shift, dims=(2, 3)) for shift in shifts], 1)  # (class, shift, 3, H, W)
    other = (1 - MIX) * templates

    def draw(n: int):
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        distractors = torch.randint(0, num_classes, (n,), generator=gen)
        shift = torch.randint(0, len(shifts), (n,), generator=gen)
        contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=gen)
        offset = 0.5 * (1 - contrast) + 0.3 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5)  # contrast about 0.5, brightness
        images = torch.empty(n, 3, image_size, image_size, dtype=torch.uint8)
        noise = torch.empty(1024, 3, image_size, image_size)
        for start in range(0, n, 1024):  # in parts that stay in the CPU's caches, computed in place: 50k in about 1 s
            part = slice(start, start + 1024)
            pixels = own[labels[part], shift[part]].add_(other[distractors[part]]).mul_(contrast[part]).add_(offset[part])
            pixels.add_(noise[:len(pixels)].normal_(0, NOISE, generator=gen))
            images[part] = pixels.clamp_(0, 1).mul_(255).round_()
        return images, labels

    train_images, train_labels = draw(n_train)
    test_images, test_labels = draw(n_test)
    return ImageData(train_images, train_labels, test_images, test_labels, num_classes)


class AugmentedImages(Dataset):
    """Item ``i``: image ``i`` randomly cropped (padding 4) and flipped, as float32, normalised; and its label.
    With ``augment=False``, only converted and normalised (for evaluation)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool = True):
        self.images, self.labels = images, labels
        steps = [v2.RandomCrop(images.shape[-1], padding=4), v2.RandomHorizontalFlip()] if augment else []
        self.transform = v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), int(self.labels[index])


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (on any device) to normalised float32, as AugmentedImages does."""
    mean, std = _constants(images.device)
    return (images.float() / 255 - mean) / std


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """MEAN and STD as (1, 3, 1, 1) tensors on ``device``, made once: building them per batch would copy them from
    the host, and wait for the device, every step."""
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1), torch.tensor(STD, device=device).view(1, 3, 1, 1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, device, batch_size: int = 1024) -> float:
    """The share of ``images`` (uint8) the model classifies right, in eval mode; its training mode is restored."""
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(labels), batch_size):
            x = normalize(images[start:start + batch_size].to(device))
            correct += (model(x).argmax(1).cpu() == labels[start:start + batch_size]).sum().item()
    finally:
        model.train(was_training)
    return correct / len(labels)


def slow_train(model: torch.nn.Module, data: ImageData, *, epochs: int, device, batch_size: int = 128,
               lr: float = 1e-3, seed: int = 0) -> list[float]:
    """The naive baseline, written the way people write it first: per-sample CPU augmentation in the main
    process, pageable blocking copies, float32, and ``loss.item()`` every step. Returns the losses."""
    loader = DataLoader(AugmentedImages(data.train_images, data.train_labels), batch_size=batch_size, shuffle=True,
                        num_workers=0, generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses
