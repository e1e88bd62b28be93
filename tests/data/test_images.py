"""Decoding image files (cat.data.images): the opt-in draft decode against timm's random resized crop."""

from __future__ import annotations

import io
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data as samples

from cat.data.images import DraftCrop, build_batch_transform, build_decoding, build_transform
from cat.data.untrusted import decode_image
from tests.conftest import typed_config

# The shipped ImageNet data section with the draft decode on, and augmentation without RandAugment or erasing.
_SHIPPED = typed_config("cls", "data=imagenet", "aug=none", "data.decode_draft=true")
DATA, AUG = _SHIPPED.data, _SHIPPED.aug


def _encoded(fmt: str, size: tuple[int, int]) -> bytes:
    """scikit-image's astronaut photograph at ``size``, encoded."""
    image = Image.fromarray(samples.astronaut()).resize(size, Image.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _both(encoded: bytes, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """timm's crop of the decoded image and the draft decode's, from the same random state; the draft's scale."""
    draft, _ = build_decoding(DATA, AUG, is_train=True)
    timm_crop = build_transform(DATA, AUG, is_train=True).transforms[0]
    random.seed(seed)
    theirs = timm_crop(decode_image(encoded, "astronaut"))
    random.seed(seed)
    ours = decode_image(encoded, "astronaut", draft)
    return np.asarray(theirs, dtype=np.float64), np.asarray(ours, dtype=np.float64), draft.last_scale


def test_without_a_draft_the_crop_is_timms_to_the_bit():
    """A PNG (no draft) and a JPEG too small to draft: the same crops, the same pixels, for every draw."""
    for encoded in (_encoded("PNG", (1024, 768)), _encoded("JPEG", (300, 240))):
        for seed in range(40):
            theirs, ours, scale = _both(encoded, seed)
            assert scale == 1.0 and np.array_equal(theirs, ours), seed


def test_a_drafted_jpeg_is_timms_crop_at_fewer_pixels():
    """A large JPEG: where the crop allows, fewer pixels are decoded; the crop is the same place and size (the
    draws are timm's), so the output differs only as a resize differs from a DCT-scaled decode."""
    encoded = _encoded("JPEG", (1600, 1200))
    scales, errors = [], []
    for seed in range(60):
        theirs, ours, scale = _both(encoded, seed)
        scales.append(scale)
        errors.append(np.abs(theirs - ours).mean())
    assert min(scales) <= 0.25 and max(scales) == 1.0  # from 1/4 scale to none, as the crops' sizes allow
    assert max(errors) < 4.0  # mean absolute difference, of 255: the same picture
    # A mismatched crop (another draw) is far off: the comparison can fail.
    random.seed(0)
    other = np.asarray(build_transform(DATA, AUG, True).transforms[0](decode_image(encoded, "x")), dtype=np.float64)
    assert np.abs(other - _both(encoded, 1)[1]).mean() > 10 * max(errors)


def test_the_draft_path_gives_the_pipelines_tensors():
    draft, rest = build_decoding(DATA, AUG, is_train=True)
    assert isinstance(draft, DraftCrop)
    tensor = rest(decode_image(_encoded("JPEG", (800, 600)), "x", draft))
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (3, 224, 224)
    # Off, or evaluating: timm's whole pipeline, no draft.
    assert build_decoding(replace(DATA, decode_draft=False), AUG, True)[0] is None
    assert build_decoding(DATA, AUG, is_train=False)[0] is None


def test_a_broken_jpeg_is_named_on_the_draft_path_too():
    from cat.errors import DataError

    draft, _ = build_decoding(DATA, AUG, is_train=True)
    with pytest.raises(DataError, match="cannot read broken.jpg"):
        decode_image(_encoded("JPEG", (800, 600))[:2000], "broken.jpg", draft)


def test_uint8_batches_normalised_on_the_device_are_timms_tensors():
    """data.normalize_on_device: the loader's uint8 image, converted and normalised as a batch, is the tensor timm's
    whole transform gives from the same random state (random erasing, moved to the batch, aside)."""
    encoded = _encoded("JPEG", (800, 600))
    on_device = replace(DATA, decode_draft=False, normalize_on_device=True)
    plain = replace(DATA, decode_draft=False)
    for seed in range(5):
        random.seed(seed)
        torch.manual_seed(seed)
        expected = build_transform(plain, AUG, True)(decode_image(encoded, "x"))
        random.seed(seed)
        torch.manual_seed(seed)
        uint8 = build_transform(on_device, AUG, True)(decode_image(encoded, "x"))
        assert uint8.dtype == torch.uint8 and uint8.shape == (3, 224, 224)
        batch = build_batch_transform(on_device, AUG, torch.device("cpu"))(uint8[None])
        torch.testing.assert_close(batch[0], expected, atol=1e-5, rtol=0)
    # With random erasing, the batch transform erases (aug.reprob=1: every image has a region of noise).
    erasing = replace(AUG, reprob=1.0)
    batch = build_batch_transform(on_device, erasing, torch.device("cpu"))(
        torch.full((4, 3, 224, 224), 128, dtype=torch.uint8)
    )
    assert all((image != image[0, 0, 0]).any() for image in batch)
    assert build_batch_transform(plain, AUG, torch.device("cpu")) is None


@pytest.mark.parametrize(("level", "expected"), [(200, 0), (65535, 255), (32896, 128), (40000, 156)])
def test_a_sixteen_bit_png_decodes_by_its_real_range(tmp_path, level, expected):
    """A 16-bit greyscale PNG at 200/65535 is black: Pillow's ``convert("RGB")`` clips it to 200/255 instead."""
    from cat.data import load_rgb

    path = tmp_path / "deep.png"
    Image.fromarray(np.full((4, 6), level, dtype=np.uint16)).save(path)
    assert Image.open(path).mode == "I;16"
    rgb = np.asarray(load_rgb(str(path)))
    assert rgb.shape == (4, 6, 3) and (rgb == expected).all()
    # The draft path (data.decode_draft=true) decodes it alike: it clipped 40000/65535 to 255 where this gives 156.
    draft, _ = build_decoding(DATA, AUG, is_train=True)
    cropped = np.asarray(load_rgb(str(path), draft=draft))
    assert cropped.shape == (224, 224, 3) and (cropped == expected).all()
