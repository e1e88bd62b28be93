"""Every shipped classification training pipeline at volume: each RandAugment op of each recipe at
every magnitude its policy can draw, thousands of random draws of the whole train transform, and the
recipes' mixup/cutmix, on generated images (transforms only, no model).

Also pins down :mod:`cat.data.augment`: the posterize it registers computes what Pillow <= 12 did.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import PIL
import pytest
import torch
from PIL import Image, ImageOps
from timm.data import auto_augment
from timm.data.auto_augment import RandAugment

from cat.classification.optimization import build_mixup
from cat.data import build_transform
from cat.data.augment import POSTERIZE_OPS, install_timm_augment_fixes, posterize
from tests.conftest import REPO, typed_cls

CLS_EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "cls" / "experiment").glob("*.yaml"))
SWEEP_SIZE = 32  # the transforms' output size here: the ops do not depend on it


@pytest.fixture(scope="module")
def recipes() -> dict[str, object]:
    """The distinct train recipes (``data`` + ``aug`` nodes) that the shipped cls experiments select
    for a file dataset (data=folder: the augmentation applies to folders only), keyed by the first
    experiment that selects each. Composed when a test here runs, not at collection: every pytest worker
    collects every file, and composing the 31 experiments takes seconds."""
    found = {}
    for experiment in CLS_EXPERIMENTS:
        cfg = typed_cls(f"experiment={experiment}", "data=folder", f"data.img_size={SWEEP_SIZE}")
        if cfg.aug.auto_augment is None and cfg.aug.mixup == 0 and cfg.aug.cutmix == 0:
            continue  # the quick-start's aug=none
        found.setdefault(repr(cfg.aug), (experiment, cfg))
    assert found, "no shipped classification recipe with augmentation"
    return dict(found.values())


def _images(rng: np.random.Generator, count: int, size: tuple[int, int] | None = None) -> list[Image.Image]:
    """RGB images of varied content: noise, smooth gradients, flat colour (the edge cases of
    autocontrast/equalize/solarize), at random sizes unless ``size`` is given."""
    images = []
    for i in range(count):
        w, h = size or (int(rng.integers(24, 96)), int(rng.integers(24, 96)))
        kind = i % 3
        if kind == 0:
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        elif kind == 1:
            ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * rng.uniform(0.2, 1.0, (1, 1, 3))
            pixels = np.broadcast_to(ramp, (h, w, 3)).astype(np.uint8)
        else:
            pixels = np.full((h, w, 3), rng.integers(0, 256, 3), dtype=np.uint8)
        images.append(Image.fromarray(np.ascontiguousarray(pixels), "RGB"))
    return images


def _rand_augment(transform) -> RandAugment:
    found = [t for t in transform.transforms if isinstance(t, RandAugment)]
    assert len(found) == 1, f"expected one RandAugment in {transform}"
    return found[0]


def test_shipped_recipes_found(recipes):
    # DeiT/PVT/Swin/CAT and CA presets all select aug=deit today; the tests cover whatever they select.
    for cfg in recipes.values():
        assert cfg.aug.auto_augment.startswith("rand-")


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_posterize_keeps_pillow_12_meaning(mode):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8), "RGB").convert(mode)
    pixels = np.asarray(image).astype(np.int64)
    for bits in range(-3, 10):
        out = posterize(image, bits)
        assert out.mode == mode and out.size == image.size
        # Pillow's documented arithmetic: keep the `bits` most significant bits (mask ~(2**(8-bits)-1)),
        # with every bit cleared at 0 or fewer and none at 8 or more.
        expected = pixels if bits >= 8 else pixels & ~(2 ** (8 - bits) - 1) & 0xFF
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=f"bits={bits}")
        if 1 <= bits <= 7:
            assert out.tobytes() == ImageOps.posterize(image, bits).tobytes()


def test_timm_posterize_fails_unfixed_on_pillow_13():
    """What the fix is for: timm's own op at level 10 of PosterizeIncreasing asks Pillow for 0 bits."""
    image = Image.new("RGB", (8, 8), (200, 100, 50))
    bits = auto_augment.LEVEL_TO_ARG["PosterizeIncreasing"](10.0, {})[0]
    assert bits == 0
    if int(PIL.__version__.split(".")[0]) < 13:
        pytest.skip(f"Pillow {PIL.__version__} still accepts 0 bits")
    with pytest.raises(ValueError, match="bits must be"):
        auto_augment.posterize(image, bits)


def test_install_registers_the_fix_for_every_posterize_op():
    install_timm_augment_fixes()
    install_timm_augment_fixes()  # idempotent
    for name in POSTERIZE_OPS:
        assert auto_augment.NAME_TO_OP[name] is posterize
        op = auto_augment.AugmentOp(name, prob=1.0, magnitude=10)
        assert copy.deepcopy(op).aug_fn is posterize


def _op_failures(op, images: list[Image.Image]) -> list[str]:
    """``op`` forced on at magnitudes 0 to its policy's upper bound in steps of 0.25, on each image: what raised
    (each image's output checked: an RGB image of the input's size)."""
    failures = []
    for magnitude in np.arange(0.0, (op.magnitude_max or 10.0) + 1e-9, 0.25):
        fixed = copy.copy(op)
        fixed.prob, fixed.magnitude_std, fixed.magnitude = 1.0, 0.0, float(magnitude)
        for image in images:
            try:
                out = fixed(image)
            except Exception as error:  # collected: the message lists every failing op
                failures.append(f"{op.name} m={magnitude}: {type(error).__name__}: {error}")
                break
            assert isinstance(out, Image.Image) and out.mode == "RGB" and out.size == image.size, op.name
    return failures


def test_every_op_at_every_magnitude(recipes):
    """A deterministic sweep: each op of each recipe's RandAugment, forced on, at every magnitude its policy
    can draw (every level threshold of timm's ops lies on the 0.25 grid :func:`_op_failures` steps)."""
    images = _images(np.random.default_rng(1), 3, size=(SWEEP_SIZE, SWEEP_SIZE))
    for experiment, cfg in recipes.items():
        rand_augment = _rand_augment(build_transform(cfg.data, cfg.aug, is_train=True))
        assert len(rand_augment.ops) == 15, experiment  # timm's increasing RandAugment set: the sweep sees them all
        failures = [failure for op in rand_augment.ops for failure in _op_failures(op, images)]
        assert not failures, f"{experiment}:\n" + "\n".join(failures)


def test_train_transform_random_draws(recipes):
    """Each recipe's whole train transform (random resized crop, flip, RandAugment, colour jitter, normalise,
    random erasing) on 3,000 images of random sizes: tensors of the right shape, dtype and values."""
    for experiment, cfg in recipes.items():
        transform = build_transform(cfg.data, cfg.aug, is_train=True)
        random.seed(0)
        torch.manual_seed(0)
        rng = np.random.default_rng(2)
        for image in _images(rng, 3000):
            out = transform(image)
            assert out.shape == (3, SWEEP_SIZE, SWEEP_SIZE) and out.dtype == torch.float32, experiment
            assert torch.isfinite(out).all(), experiment
        val = build_transform(cfg.data, cfg.aug, is_train=False)(_images(rng, 1)[0])
        assert val.shape == (3, SWEEP_SIZE, SWEEP_SIZE), experiment


def test_mixup_cutmix_draws(recipes):
    """Each recipe's mixup/cutmix over 500 batches: both branches drawn, mixed targets that are
    distributions with the label smoothing floor."""
    num_classes = 10
    for experiment, cfg in recipes.items():
        mixup = build_mixup(cfg.aug, num_classes)
        assert mixup is not None, experiment
        torch.manual_seed(0)
        np.random.seed(0)
        used_cutmix = set()
        for _ in range(500):
            x = torch.randn(8, 3, SWEEP_SIZE, SWEEP_SIZE)
            y = torch.randint(0, num_classes, (8,))
            mixed, target = mixup(x.clone(), y)  # timm mixes in place
            assert mixed.shape == x.shape and mixed.dtype == x.dtype and torch.isfinite(mixed).all(), experiment
            assert target.shape == (8, num_classes), experiment
            torch.testing.assert_close(target.sum(1), torch.ones(8), msg=experiment)
            assert target.min() >= cfg.aug.smoothing / num_classes - 1e-6, experiment
            used_cutmix.add(_is_box_mix(x, mixed))
        assert used_cutmix == {True, False}, f"{experiment}: 500 batches should draw both mixup and cutmix"


def _is_box_mix(x: torch.Tensor, mixed: torch.Tensor) -> bool:
    """Cutmix pastes a box of the flipped batch; mixup blends every pixel."""
    unchanged = (mixed == x).all(dim=1)
    return bool(unchanged.any())
