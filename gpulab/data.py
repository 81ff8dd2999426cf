"""Synthetic image data for the input-pipeline lessons: no download, the same on every machine.

Images are uniform noise made from their index with a seeded generator (a stand-in for reading and
decoding a file); ``augmentation`` is a typical ImageNet-style training transform, CPU-heavy like
the real thing. The dataset lives in this package, not in a notebook, so that DataLoader workers
can import it under any start method (fork on Linux, spawn on macOS and Windows).
"""

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def augmentation(crop: int) -> v2.Compose:
    """Random resized crop, flip and colour jitter on a uint8 image, then float32, normalised."""
    return v2.Compose([
        v2.RandomResizedCrop(crop, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])


class SyntheticImages(Dataset):
    """``n`` RGB images of ``image_size``² pixels with labels in ``range(num_classes)``.

    Item ``i`` is ``(augmentation(crop)(image_i), label_i)``; with ``augment=False`` it is the raw
    uint8 image (3, image_size, image_size) and its label.
    """

    def __init__(self, n: int, image_size: int = 256, crop: int = 224, num_classes: int = 10,
                 augment: bool = True, seed: int = 0):
        if n <= 0 or crop > image_size:
            raise ValueError(f"need n > 0 and crop <= image_size, got n={n}, crop={crop}, image_size={image_size}")
        self.n, self.image_size, self.crop, self.num_classes, self.seed = n, image_size, crop, num_classes, seed
        self.transform = augmentation(crop) if augment else None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} images")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randint(0, 256, (3, self.image_size, self.image_size), dtype=torch.uint8, generator=generator)
        label = int(torch.randint(0, self.num_classes, (), generator=generator))
        return (self.transform(image) if self.transform else image), label


def image_tensors(n: int, image_size: int = 32, num_classes: int = 10, seed: int = 0):
    """A small data set as two tensors, ready to live on the GPU: uint8 images (n, 3, s, s), int64 labels (n,)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, image_size, image_size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (n,), generator=generator)
    return images, labels
