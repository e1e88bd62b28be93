"""tools/export_folder.py: the quick-start's digits as an image folder other tools read."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

from cat.data.tensor_sets import digits_images


def test_the_export_is_the_quick_starts_split_up_to_8_bit_rounding(tmp_path, run_tool):
    out = tmp_path / "digits"
    assert "wrote 1437 train and 360 val digits" in run_tool("export_folder", str(out))
    for split in ("train", "val"):
        folder = ImageFolder(str(out / split))  # torchvision's reader, as timm's train.py reads a folder
        images, labels = digits_images(split)
        assert folder.classes == [str(d) for d in range(10)] and len(folder) == len(labels)
        assert sorted(folder.targets) == sorted(labels.tolist())
        # Each file holds its image: the index in the name is the position in the split.
        for path, label in folder.samples[::97]:
            index = int(path.rsplit("/", 1)[1].removesuffix(".png"))
            pixels = torch.from_numpy(np.asarray(Image.open(path), dtype=np.float32) / 255)
            assert label == labels[index] and pixels.shape == (32, 32)
            assert (pixels - images[index, 0]).abs().max() <= 0.5 / 255 + 1e-6
    assert "is not empty" in run_tool("export_folder", str(out), expect=2, stderr=True)
    # A link planted at the name (to an empty folder elsewhere) is refused, not written through.
    elsewhere, link = tmp_path / "elsewhere", tmp_path / "link"
    elsewhere.mkdir()
    link.symlink_to(elsewhere)
    assert "is not a folder (a link" in run_tool("export_folder", str(link), expect=2, stderr=True)
    assert not any(elsewhere.iterdir())
