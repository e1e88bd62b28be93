"""timm's augmentation ops, made to mean the same thing on every Pillow the project allows.

timm's RandAugment/AutoAugment posterize ops pass ``bits_to_keep`` straight to
``PIL.ImageOps.posterize``. Their level functions can ask for 0 bits ("keep 4 down to 0 most
significant bits": ``PosterizeIncreasing`` at magnitude 10, ``Posterize`` below magnitude 2.5, and
negative counts once ``mmax`` lifts the magnitude past 10). Pillow up to 12 turned that into an
all-black image (the mask ``~(2**8 - 1)`` clears every bit); Pillow 13 raises ``ValueError: bits
must be between or equal to 1 and 8``, which kills a DataLoader worker a few hundred images into
DeiT's ``rand-m9-mstd0.5-inc1``. :func:`install_timm_augment_fixes` registers a posterize in
timm's op table that keeps the published recipes' meaning (0 or fewer bits: every channel 0) and
hands every other count to Pillow unchanged.
"""

from __future__ import annotations

from PIL import Image, ImageOps
from timm.data import auto_augment

__all__ = ["POSTERIZE_OPS", "install_timm_augment_fixes", "posterize"]

# timm's op names whose level can reach 0 bits; all three share timm's one posterize function.
POSTERIZE_OPS = ("Posterize", "PosterizeIncreasing", "PosterizeOriginal")


def posterize(img: Image.Image, bits_to_keep: int, **_: object) -> Image.Image:
    """Keep the ``bits_to_keep`` most significant bits of each channel (timm's op signature).

    8 or more bits: the image unchanged (as timm); 1-7: Pillow's posterize; 0 or fewer: every
    channel cleared, which is what Pillow <= 12 computed for those counts on L and RGB images.
    """
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0 and img.mode in ("L", "RGB"):
        return img.point([0] * 256 * len(img.getbands()))
    return ImageOps.posterize(img, bits_to_keep)


def install_timm_augment_fixes() -> None:
    """Register :func:`posterize` for timm's posterize ops (idempotent). timm's ``AugmentOp`` looks
    its function up when it is built, so this must run before the transform is created; the op then
    pickles by reference to this module, so spawned DataLoader workers get the same function."""
    for name in POSTERIZE_OPS:
        if name in auto_augment.NAME_TO_OP:
            auto_augment.NAME_TO_OP[name] = posterize
