"""The capstone's job: a CIFAR-shaped image task that needs no download and that accuracy can fail on, the speedrun
network and recipe that train it, and the naive training loop the graded exercise has to beat.

``make_dataset`` draws images of a fixed task (its ten classes' patterns are the same for every seed; the seed draws
the images), stored as uint8 arrays like decoded image files: each image is its class's smooth colour pattern,
shifted, flipped, lit and contrasted at random, with a faint pattern of another class and pixel noise mixed in. The
naive recipe needs several epochs to reach its accuracy, and each broken step a learner could write (labels
shuffled against images, the normalisation forgotten, a larger batch without its learning rate) costs several
points. ``cifar10`` gives the real CIFAR-10 in the same form where torchvision can download it. ``AugmentedImages``
is the per-sample CPU augmentation people write first; ``augmentation`` draws an epoch's order, crops and flips from a
seed, so that two pipelines (one image at a time on the CPU, a whole batch on the device) train on the same images in
the same order. The speed-ups themselves are written out in lesson 08.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from .mode import by_mode

TASK_SEED = 2026  # draws the classes' patterns: one task, whatever the seed of the images
SHIFT, PATTERN = 3, 6  # the largest shift of an image's pattern (pixels), and the grid its smooth pattern is drawn on
PAD = 4  # the augmentation crops each image from its copy padded by this many pixels (zeros)
# The own pattern's share (the rest: another class's) and the pixel noise: harder in full mode, where a wide network
# sees ten times the images (the naive job still needs most of its epochs there), easier in quick mode, where a narrow
# one sees few. Measured with the quick network: quick mode's job reaches 82-98 % in 3 epochs of 1,536 images over 6
# seeds (median 95 %); full mode's data takes it from 72 % after one epoch to 96.5 % after six of 16,384.
MIX, NOISE = by_mode(full=(0.6, 0.35), quick=(0.85, 0.15))
# Per-channel mean and standard deviation of the pixels (over 0..1), measured on make_dataset(50_000, 0, seed=0) in
# each mode; other seeds move them by less than 0.01.
MEAN, STD = by_mode(full=((0.504, 0.505, 0.515), (0.328, 0.329, 0.328)),
                    quick=((0.505, 0.506, 0.518), (0.265, 0.267, 0.264)))
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class Sizes:
    """The job's size in this mode: the network's widths, the images, the epochs (each raced in ``rounds`` parts),
    the naive recipe's batch and learning rate (SGD with Nesterov momentum; the rate peaks after a warm-up, then
    falls to zero), and how many times larger the larger batch of lesson 08's path is."""

    widths: tuple
    n_train: int
    n_test: int
    epochs: int
    rounds: int
    batch: int
    lr: float
    larger: int


    @property
    def images_per_round(self) -> int:
        """A round is a fixed share of an epoch's full batches (a last, partial batch is dropped)."""
        return self.n_train // self.batch // self.rounds * self.batch

    @property
    def images_per_run(self) -> int:
        return self.epochs * self.rounds * self.images_per_round


# Quick mode's few steps want a small batch: 4x the batch there leaves 18 steps, too few to learn the task. Lesson 08
# and its exercise's check (gpulab.questions.lesson08.job()) train the job the plan sizes from the card
# (gpulab/plans/plan08.py: FULL_SIZES' recipe, with the full network on the fastest cards and narrower ones and fewer
# images where the path would not fit its minutes; QUICK_SIZES in quick mode); SIZES holds the mode's batch and learning
# rate where none is given (slow_train).
FULL_SIZES = Sizes((64, 256, 512, 1024), 16_384, 4096, 5, 4, 256, 0.1, 4)
QUICK_SIZES = Sizes((4, 8, 16, 32), 1536, 1024, 3, 3, 64, 0.05, 2)
SIZES = by_mode(full=FULL_SIZES, quick=QUICK_SIZES)
MOMENTUM, WEIGHT_DECAY, LABEL_SMOOTHING, WARMUP = 0.9, 5e-4, 0.2, 0.2
# The seeds of lesson 08's noise measurement (besides seed 0, which every race trains from); the first steps whose
# losses a step that changes no arithmetic must follow the configuration before it on, and the share of another seed's
# gap over those steps it must stay within. Measured in quick mode on a CPU over seeds 0-39 (first rounds of 8 steps;
# tests/test_lesson08_verdicts.py runs seeds 0-3): in bf16 autocast, where rounding is 2^-8, a one-ulp float32 nudge of
# every starting weight, or a bf16-ulp jitter of every weight before every step, moves the first 3 steps' losses by at
# most 0.15 of another seed's gap, where other crops, flips and order from the same weights move them by 0.27 or more
# (float32 rounding: under 0.01). Over the whole first round, which training's amplification of rounding reaches,
# the two overlapped (bf16 jitter up to 0.52, other draws from 0.44). 0.2 lies between.
NOISE_SEEDS, LOSS_STEPS, LOSS_SHARE = (1, 2), 3, 0.2


@dataclass
class ImageData:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,), for training and for testing, and the pixels' per-channel
    mean and standard deviation (over 0..1) to normalise them with."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int = 10
    mean: tuple = MEAN
    std: tuple = STD


def make_dataset(n_train: int, n_test: int, *, image_size: int = 32, num_classes: int = 10, seed: int = 0) -> ImageData:
    """``n_train`` + ``n_test`` images of the capstone's task, the same for the same arguments on every machine."""
    patterns = F.interpolate(torch.rand(num_classes, 3, PATTERN, PATTERN, generator=torch.Generator().manual_seed(
        TASK_SEED)), size=image_size, mode="bicubic", align_corners=False)  # one smooth colour pattern per class
    shifts = [(dy, dx) for dy in range(-SHIFT, SHIFT + 1) for dx in range(-SHIFT, SHIFT + 1)]
    own = MIX * torch.stack([torch.stack([patterns.roll(s, dims=(2, 3)) for s in shifts], 1),
                             torch.stack([patterns.flip(3).roll(s, dims=(2, 3)) for s in shifts], 1)], 1)
    other = (1 - MIX) * patterns
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int):
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        distractors = torch.randint(0, num_classes, (n,), generator=gen)
        flip = torch.randint(0, 2, (n,), generator=gen)
        shift = torch.randint(0, len(shifts), (n,), generator=gen)
        contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=gen)
        offset = 0.5 * (1 - contrast) + 0.3 * (torch.rand(n, 3, 1, 1, generator=gen) - 0.5)  # contrast, tint
        images = torch.empty(n, 3, image_size, image_size, dtype=torch.uint8)
        noise = torch.empty(1024, 3, image_size, image_size)
        for start in range(0, n, 1024):  # in parts that stay in the CPU's caches, computed in place
            part = slice(start, start + 1024)
            pixels = own[labels[part], flip[part], shift[part]].add_(other[distractors[part]])
            pixels.mul_(contrast[part]).add_(offset[part]).add_(noise[:len(pixels)].normal_(0, NOISE, generator=gen))
            images[part] = pixels.clamp_(0, 1).mul_(255).round_()
        return images, labels

    train_images, train_labels = draw(n_train)
    test_images, test_labels = draw(n_test)
    return ImageData(train_images, train_labels, test_images, test_labels, num_classes)


def cifar10(root: str = "data") -> ImageData:
    """The real CIFAR-10 (50,000 training and 10,000 test images), downloaded by torchvision into ``root``, in the
    same form as ``make_dataset``'s: where there is internet (Colab), the lesson runs on it unchanged."""
    from torchvision.datasets import CIFAR10

    def tensors(train: bool):
        raw = CIFAR10(root, train=train, download=True)
        return torch.from_numpy(raw.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(raw.targets)

    (train_images, train_labels), (test_images, test_labels) = tensors(True), tensors(False)
    return ImageData(train_images, train_labels, test_images, test_labels, 10, CIFAR10_MEAN, CIFAR10_STD)


@dataclass(frozen=True)
class Augmentation:
    """One epoch's random choices, for ``n`` images: the order they are trained in, and for the ``k``-th of that order
    its crop (``dy[k]``, ``dx[k]``: 0 to 8 pixels into the image padded by 4) and whether it is flipped (``flip[k]``)."""

    order: torch.Tensor
    dy: torch.Tensor
    dx: torch.Tensor
    flip: torch.Tensor


def augmentation(n: int, seed: int, epoch: int) -> Augmentation:
    """Epoch ``epoch``'s order, crops and flips of ``n`` images, drawn on the CPU from ``seed`` and ``epoch`` alone:
    the same on every device, for every pipeline, however many other random numbers were drawn before."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=gen)
    dy, dx = torch.randint(0, 2 * PAD + 1, (2, n), generator=gen)
    return Augmentation(order, dy, dx, torch.rand(n, generator=gen) < 0.5)


class AugmentedImages(Dataset):
    """Item ``i``: image ``i`` randomly cropped (padding 4) and flipped by torchvision, as float32, normalised with
    ``mean`` and ``std``; and its label. With ``augment=False``, only converted and normalised (for evaluation).

    With ``drawn`` (an epoch's ``Augmentation``), item ``k`` is instead the ``k``-th image of that epoch's order, cropped
    and flipped as drawn, one image at a time, and normalised as ``normalize`` does a batch: the same numbers as the
    batch pipeline of lesson 08 makes from the same draws."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool = True, mean=MEAN, std=STD,
                 drawn: Augmentation | None = None):
        self.images, self.labels, self.mean, self.std, self.drawn = images, labels, mean, std, drawn
        steps = [v2.RandomCrop(images.shape[-1], padding=PAD), v2.RandomHorizontalFlip()] if augment else []
        self.transform = v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.drawn is None:
            return self.transform(self.images[index]), int(self.labels[index])
        drawn, size = self.drawn, self.images.shape[-1]
        i = int(drawn.order[index])
        image = v2.functional.crop(v2.functional.pad(self.images[i], [PAD]), int(drawn.dy[index]),
                                   int(drawn.dx[index]), size, size)
        if drawn.flip[index]:
            image = v2.functional.horizontal_flip(image)
        return normalize(image, self.mean, self.std), int(self.labels[i])


def normalize(images: torch.Tensor, mean=MEAN, std=STD) -> torch.Tensor:
    """uint8 images (a batch, or one image; on any device) to normalised float32, as AugmentedImages does."""
    m, s = _constants(images.device, tuple(mean), tuple(std))
    return (images.float() / 255 - m) / s


@functools.cache
def _constants(device: torch.device, mean: tuple, std: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean`` and ``std`` as (3, 1, 1) tensors on ``device``, made once: building them per batch would copy them
    from the host, and wait for the device, every step."""
    return (torch.tensor(mean, device=device).view(-1, 1, 1), torch.tensor(std, device=device).view(-1, 1, 1))


def lr_at(step: int, total_steps: int, peak: float) -> float:
    """The recipe's learning rate at ``step`` of ``total_steps``: a linear warm-up to ``peak`` over the first
    ``WARMUP`` share of the steps, then a linear fall to zero (the one-cycle shape the speedruns use)."""
    warmup = max(1, round(WARMUP * total_steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(total_steps - step, 0) / max(total_steps - warmup, 1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, device, batch_size: int = 1024,
             mean=MEAN, std=STD) -> float:
    """The share of ``images`` (uint8) the model classifies right, in eval mode; its training mode is restored."""
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(labels), batch_size):
            x = normalize(images[start:start + batch_size].to(device), mean, std)
            correct += (model(x).argmax(1).cpu() == labels[start:start + batch_size]).sum().item()
    finally:
        model.train(was_training)
    return correct / len(labels)


def slow_train(model: torch.nn.Module, data: ImageData, *, epochs: int, device, batch_size: int | None = None,
               lr: float | None = None, seed: int = 0) -> list[float]:
    """The naive baseline, written the way people write it first: per-sample CPU augmentation in the main
    process, pageable blocking copies, float32, and ``loss.item()`` every step; the speedrun recipe (SGD with
    Nesterov momentum, the learning rate warmed up then decayed, label smoothing). Returns the losses."""
    batch_size, lr = batch_size or SIZES.batch, lr or SIZES.lr
    loader = DataLoader(AugmentedImages(data.train_images, data.train_labels, mean=data.mean, std=data.std),
                        batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0,
                        generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)
    total, step, losses = epochs * len(loader), 0, []
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, lr)
            loss = F.cross_entropy(model(x), y, label_smoothing=LABEL_SMOOTHING)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
    return losses
