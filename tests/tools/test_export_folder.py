"""tools/export_folder.py: the quick-start's digits as an image folder other tools read."""

from __future__ import annotations

import os

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


def test_paths_stay_where_they_say_and_nothing_is_overwritten(tmp_path, run_tool):
    """'X/new/..' is X: refused when X holds anything (it overwrote 10 of 100 files before), and a name under a file,
    an unwritable place or an oversized image ends in one line with nothing written."""
    full = tmp_path / "full"
    (full / "train" / "3").mkdir(parents=True)
    (full / "train" / "3" / "00000.png").write_bytes(b"mine")
    err = run_tool("export_folder", f"{full}/new/..", expect=2, stderr=True)
    assert f"({full}) is not empty" in err and (full / "train" / "3" / "00000.png").read_bytes() == b"mine"
    assert not (full / "new").exists()
    (tmp_path / "a_file").write_text("x")
    err = run_tool("export_folder", str(tmp_path / "a_file" / "under"), expect=2, stderr=True)
    assert "cannot write the digits into" in err and "Not a directory" in err and "Traceback" not in err
    err = run_tool("export_folder", str(tmp_path / "big"), "--img-size", "100000", expect=2, stderr=True)
    assert "--img-size 100000: at most 512" in err and not (tmp_path / "big").exists()
    long_name = tmp_path / ("a" * 300)  # over the filesystem's 255 bytes a name
    err = run_tool("export_folder", str(long_name), expect=2, stderr=True)
    assert "File name too long" in err and len(err.strip().splitlines()[-1]) < 600
    for place in ("/proc/cat-export", "/sys/cat-export"):  # the kernel's own folders take no files
        err = run_tool("export_folder", place, expect=2, stderr=True)
        assert f"cannot write the digits into {place}:" in err and not os.path.exists(place)
