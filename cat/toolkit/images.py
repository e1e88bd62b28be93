"""Images for the analysis tools: a folder or file of the user's, else scikit-image's bundled samples
(no download), preprocessed the way the model's pretrained config says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from timm.data import create_transform, resolve_data_config
from torch import Tensor, nn

from cat.errors import DataError

__all__ = [
    "IMAGE_SUFFIXES",
    "SAMPLE_IMAGES",
    "sample_images",
    "image_paths",
    "read_image",
    "load_images",
    "to_model_input",
]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
SAMPLE_IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")  # in skimage.data


def sample_images(names: tuple[str, ...] = SAMPLE_IMAGES) -> list[np.ndarray]:
    """scikit-image's bundled colour photographs (RGB uint8)."""
    from skimage import data

    return [getattr(data, name)() for name in names]


def image_paths(source: str, limit: int) -> list[Path]:
    """The image files ``source`` names: itself, or up to ``limit`` of a folder's (sorted by name). An empty name
    (an unset shell variable) is refused, never read as the working directory."""
    if not source.strip():
        raise DataError("the image path is empty (an unset variable?): name an image file or a folder of images")
    path = Path(source)
    if path.is_file():
        paths = [path]
    elif path.is_dir():
        paths = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())[:limit]
    else:
        raise DataError(f"{source}: no such image file or folder")
    if not paths:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {source}")
    return paths


def read_image(path: Path) -> np.ndarray:
    """An image file as RGB uint8, as a camera meant it: turned as its EXIF orientation says, and 16-bit samples
    scaled to 8 bits (a plain conversion clips every value above 255 to white). DataError for a file that is not a
    readable image, or one past PIL's decompression-bomb limit (decoded, it would fill the memory)."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened)
            if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 16-bit greyscale (PIL reads it as I)
                grey = np.asarray(image, dtype=np.float64) / 257.0
                return np.repeat(np.clip(np.rint(grey), 0, 255).astype(np.uint8)[..., None], 3, axis=-1)
            return np.asarray(image.convert("RGB"))
    except Image.DecompressionBombError as error:
        raise DataError(f"{path}: too large to decode safely ({error})") from None
    except (OSError, ValueError, SyntaxError) as error:
        raise DataError(f"{path}: not a readable image ({error})") from None


def load_images(source: str | None, limit: int) -> list[np.ndarray]:
    """Up to ``limit`` RGB uint8 images: from an image file, a folder of them, or (``None``) the samples."""
    if source is None:
        return sample_images()[:limit]
    return [read_image(path) for path in image_paths(source, limit)]


def to_model_input(images: list[np.ndarray], model: nn.Module, img_size: int) -> Tensor:
    """A batch resized (no crop) to ``img_size`` and normalised with the model's mean and std."""
    from PIL import Image

    config = resolve_data_config({"input_size": (3, img_size, img_size), "crop_pct": 1.0}, model=model)
    transform = create_transform(**config)
    return torch.stack([transform(Image.fromarray(image)) for image in images])
