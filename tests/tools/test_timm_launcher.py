"""``python -m cat.timm SCRIPT ARGS``: timm's command-line scripts run with cat's models registered.

timm's own scripts live in its git repository, not in the pip package, and this machine cannot
fetch them; the script below does what timm's validate.py does with a model name (create it by name,
resolve its data config, timm's folder dataset, transforms and loader, top-1), written here. With
``TIMM_SCRIPTS`` pointing at a pytorch-image-models checkout, the real validate.py runs as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from tests import prewarmed
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out

VALIDATE_LIKE = """
import argparse, json
import timm, torch
from timm.data import create_dataset, create_loader, resolve_data_config

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("--model", required=True)
parser.add_argument("--img-size", type=int)
args = parser.parse_args()
model = timm.create_model(args.model, num_classes=10).eval()
config = resolve_data_config({"input_size": (3, args.img_size, args.img_size)}, model=model)
loader = create_loader(create_dataset("", root=args.data), batch_size=4, use_prefetcher=False, **config)
correct = total = 0
with torch.no_grad():
    for images, labels in loader:
        correct += (model(images).argmax(1) == labels).sum().item()
        total += len(labels)
print(json.dumps({"model": args.model, "images": total, "top1": 100 * correct / total}))
"""


@pytest.fixture(scope="module")
def digit_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    digits = load_digits()
    for label in range(10):
        (root / str(label)).mkdir()
        for i, image in enumerate(digits.images[digits.target == label][:2]):
            pixels = np.kron(image * 255 / 16, np.ones((4, 4))).astype(np.uint8)
            Image.fromarray(pixels).convert("RGB").save(root / str(label) / f"{i}.png")
    return root


def run(*args: str, fresh: bool = True) -> subprocess.CompletedProcess:
    """``python ARGS``: in a fresh interpreter, where what a script sees registered is the point (the prewarmed one
    has imported cat, so timm knows its models); ``fresh=False``: forked from the prewarmed interpreter."""
    runner = subprocess.run if fresh else prewarmed.run
    return runner([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_script_sees_cat_models_only_through_the_launcher(digit_folder, tmp_path):
    script = tmp_path / "validate_like.py"
    script.write_text(VALIDATE_LIKE)
    args = [str(digit_folder), "--model", "ca_deit_tiny", "--img-size", "32"]
    launched = run("-m", "cat.timm", str(script), *args)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert '"model": "ca_deit_tiny", "images": 20' in launched.stdout
    plain = run(str(script), *args)
    assert plain.returncode != 0 and "ca_deit_tiny" in plain.stderr  # timm: unknown model


def test_launcher_errors():
    # What it refuses does not depend on what is registered: forked from the prewarmed interpreter.
    missing = run("-m", "cat.timm", "no_such_script.py", fresh=False)
    assert missing.returncode != 0 and "no script 'no_such_script.py'" in missing.stderr
    assert run("-m", "cat.timm", fresh=False).returncode == 2


@pytest.mark.skipif(not os.environ.get("TIMM_SCRIPTS"), reason="TIMM_SCRIPTS (a pytorch-image-models checkout) not set")
def test_real_validate_py(digit_folder):
    validate = Path(os.environ["TIMM_SCRIPTS"]) / "validate.py"
    result = run(
        "-m", "cat.timm", str(validate), str(digit_folder), "--model", "ca_deit_tiny", "--num-classes", "10",
        "--img-size", "32", "--batch-size", "4", "--workers", "0", "--no-prefetcher", "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Top-1" in result.stdout + result.stderr
