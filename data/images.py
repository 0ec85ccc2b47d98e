"""Image datasets that transform each sample when it is read: uint8 images held in memory, or image
files decoded on access (so, with num_workers > 0, decoding and augmentation run in DataLoader workers).

Items are `(image float32 (C, H, W), label int64 scalar tensor)`; torch's default collation stacks them.
Access is by index, so a loader can start mid-epoch. See runner/data/transforms.py for where the
randomness of the transforms comes from.

Read by plain index, a sample's augmentation depends on the state of the reading process's global RNG,
so with DataLoader workers it depends on the number of workers and, after a resume, on where the
workers were restarted. Read by `(index, seed)` it depends on that seed alone: a loader that derives
the seed from (run seed, epoch, index) gets the same augmented samples for any worker count, any
number of ranks, and across a resume mid-epoch (datasets that accept such keys say so with
`takes_sample_seeds = True`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from torch.utils.data import Dataset

# torchvision.io decodes these natively (libjpeg-turbo, libpng, libwebp); other formats go through PIL
NATIVE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class AugmentedImages(Dataset):
    """uint8 images and labels, with `transform` applied to each sample in `__getitem__`.

    `images` is a uint8 tensor [N, C, H, W] in memory, or N file paths that `decode` turns into uint8
    (C, H, W) tensors. Readable by index or by (index, seed); see the module docstring.
    """

    takes_sample_seeds = True

    def __init__(self, images: Union[torch.Tensor, Sequence[str]], labels: torch.Tensor, transform: Callable,
                 decode: Optional[Callable[[str], torch.Tensor]] = None):
        if isinstance(images, torch.Tensor):
            if images.dtype != torch.uint8 or images.dim() != 4:
                raise ValueError(f"images: a {images.dtype} tensor of shape {tuple(images.shape)}; "
                                 f"allowed: uint8 [N, C, H, W]")
        elif decode is None:
            raise ValueError("decode: file paths need a decode function; allowed: a callable path -> uint8 image")
        if len(images) != len(labels):
            raise ValueError(f"labels: {len(labels)} labels for {len(images)} images; allowed: one per image")
        self.images, self.labels = images, labels.long()
        self.transform, self.decode = transform, decode

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: Union[int, tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(key, tuple):
            return self._read(key)
        index, seed = key
        # torchvision's transforms draw from the global CPU generator and accept no generator of their own,
        # so it is seeded for this sample and restored after; the generator itself, since torch.manual_seed
        # also seeds every accelerator backend and costs ~60x more
        rng = torch.default_generator
        saved = rng.get_state()
        rng.manual_seed(seed)
        try:
            return self._read(index)
        finally:
            rng.set_state(saved)

    def _read(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.decode is not None:
            image = self.decode(image)  # type: ignore[arg-type]
        return self.transform(image), self.labels[index]


class ImageDecoder:
    """Decode an image file to uint8 RGB (3, H, W): resized to image_size x image_size (shorter side to
    image_size, then centre crop, keeping the aspect ratio) when image_size is given, else checked to
    be exactly `size` (H, W), since the images of a batch must share one shape.

    A class rather than a closure so that DataLoader workers started by spawn can pickle it.
    """

    def __init__(self, image_size: Optional[int] = None, size: Optional[tuple[int, int]] = None):
        self.image_size, self.size = image_size, size

    def __call__(self, path: str) -> torch.Tensor:
        image = read_rgb(path)
        if self.image_size is not None:
            from torchvision.transforms.v2 import functional as F

            image = F.center_crop(F.resize(image, [self.image_size], antialias=True), [self.image_size] * 2)
        elif self.size is not None and tuple(image.shape[1:]) != self.size:
            raise ValueError(f"image_size: {path} is {image.shape[1]}x{image.shape[2]} but the first training "
                             f"image is {self.size[0]}x{self.size[1]}; set image_size to resize every image")
        return image


def read_rgb(path: str) -> torch.Tensor:
    """uint8 RGB (3, H, W) of one image file, EXIF orientation applied (as photo viewers show it)."""
    from torchvision.io import ImageReadMode, decode_image

    if Path(path).suffix.lower() in NATIVE_SUFFIXES:
        return decode_image(path, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    from PIL import Image, ImageOps
    from torchvision.transforms.v2 import functional as F

    with Image.open(path) as picture:
        return F.pil_to_tensor(ImageOps.exif_transpose(picture).convert("RGB"))
