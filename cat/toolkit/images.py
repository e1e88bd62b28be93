"""Images for the analysis tools: a folder or file of the user's, else scikit-image's bundled samples
(no download), preprocessed the way the model's pretrained config says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from timm.data import create_transform, resolve_data_config
from torch import Tensor, nn

from cat.errors import DataError

__all__ = ["IMAGE_SUFFIXES", "SAMPLE_IMAGES", "sample_images", "load_images", "to_model_input"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
SAMPLE_IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")  # in skimage.data


def sample_images(names: tuple[str, ...] = SAMPLE_IMAGES) -> list[np.ndarray]:
    """scikit-image's bundled colour photographs (RGB uint8)."""
    from skimage import data

    return [getattr(data, name)() for name in names]


def load_images(source: str | None, limit: int) -> list[np.ndarray]:
    """Up to ``limit`` RGB uint8 images: from an image file, a folder of them, or (``None``) the samples."""
    from PIL import Image

    if source is None:
        return sample_images()[:limit]
    path = Path(source)
    if path.is_file():
        paths = [path]
    elif path.is_dir():
        paths = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    else:
        raise DataError(f"{source}: no such image file or folder")
    if not paths:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {source}")
    images = []
    for p in paths:
        try:
            images.append(np.asarray(Image.open(p).convert("RGB")))
        except OSError as error:
            raise DataError(f"{p}: not a readable image ({error})") from None
    return images


def to_model_input(images: list[np.ndarray], model: nn.Module, img_size: int) -> Tensor:
    """A batch resized (no crop) to ``img_size`` and normalised with the model's mean and std."""
    from PIL import Image

    config = resolve_data_config({"input_size": (3, img_size, img_size), "crop_pct": 1.0}, model=model)
    transform = create_transform(**config)
    return torch.stack([transform(Image.fromarray(image)) for image in images])
