"""``import cat.mm`` changes nothing for a stock mmdet/mmseg user's checkpoints: mmdet 2.x's and mmseg 0.x's class
names and palettes, versions and loop state reach the stock calls as they would without cat; only what mmengine
would execute as Python (a checkpoint's embedded config) is kept from it, and a refusal names what it refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO, TOY_RUN_S

mmdet = pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
mmseg = pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

from cat.mm.safe_load import load_from_safe_local, sanitize_mm_checkpoint  # noqa: E402
from cat.models.loading import UnsafeCheckpointError  # noqa: E402

MIM_DET = Path(mmdet.__file__).parent / ".mim" / "configs"
MIM_SEG = Path(mmseg.__file__).parent / ".mim" / "configs"


@pytest.fixture(scope="module")
def stock_files(tmp_path_factory) -> Path:
    """Stock configs (mmdet's RetinaNet R18, mmseg's FCN R18, heads narrowed to the classes below), their weights
    saved as mmdet 2.x and mmseg 0.x saved them (meta with CLASSES, PALETTE, versions, the config as text), and an
    image."""
    from mmdet.registry import MODELS as DET_MODELS
    from mmdet.utils import register_all_modules as register_det
    from mmengine.config import Config
    from mmseg.registry import MODELS as SEG_MODELS
    from mmseg.utils import register_all_modules as register_seg
    from PIL import Image

    folder = tmp_path_factory.mktemp("stock")
    (folder / "det.py").write_text(
        f"_base_ = {str(MIM_DET / 'retinanet' / 'retinanet_r18_fpn_1x_coco.py')!r}\n"
        "model = dict(bbox_head=dict(num_classes=2), test_cfg=dict(score_thr=0.0))\n"
    )
    (folder / "seg.py").write_text(
        f"_base_ = {str(MIM_SEG / 'fcn' / 'fcn_r18-d8_4xb2-80k_cityscapes-512x1024.py')!r}\n"
        "model = dict(decode_head=dict(num_classes=3), auxiliary_head=dict(num_classes=3), "
        "test_cfg=dict(mode='whole'))\n"
        "test_pipeline = [dict(type='LoadImageFromFile'), dict(type='Resize', scale=(64, 64), keep_ratio=True), "
        "dict(type='PackSegInputs')]\n"
    )
    torch.manual_seed(0)
    register_det()
    cfg = Config.fromfile(folder / "det.py")
    cfg.model.backbone.init_cfg = None
    meta = {"mmdet_version": "2.28.2", "mmcv_version": "1.7.1", "CLASSES": ("cat_a", "cat_b"), "epoch": 12}
    meta |= {"iter": 100, "time": "Mon Jan  1 00:00:00 2024", "config": cfg.pretty_text}
    torch.save({"meta": meta, "state_dict": DET_MODELS.build(cfg.model).state_dict()}, folder / "det_mmdet2.pth")
    register_seg()
    cfg = Config.fromfile(folder / "seg.py")
    cfg.model.backbone.init_cfg, cfg.model.pretrained = None, None
    meta = {"mmseg_version": "0.30.0", "CLASSES": ("sky", "road", "tree"), "iter": 80000, "config": cfg.pretty_text}
    meta |= {"PALETTE": [[0, 0, 255], [128, 64, 128], [0, 128, 0]], "hook_msgs": {"last_ckpt": "iter_80000.pth"}}
    torch.save({"meta": meta, "state_dict": SEG_MODELS.build(cfg.model).state_dict()}, folder / "seg_mmseg0.pth")
    Image.fromarray((np.random.default_rng(0).random((64, 80, 3)) * 255).astype(np.uint8)).save(folder / "image.jpg")
    return folder


def stock_calls(folder: Path, with_cat: bool) -> dict:
    """tests/mm/stock_calls.py in a fresh interpreter, with or without ``import cat.mm`` first."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.mm.stock_calls", "cat" if with_cat else "plain", str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TOY_RUN_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh interpreters building a RetinaNet and an FCN
def test_stock_calls_give_the_same_results_with_and_without_cat_mm(stock_files):
    plain, with_cat = stock_calls(stock_files, False), stock_calls(stock_files, True)
    assert with_cat["det_meta"]["classes"] == ["cat_a", "cat_b"]  # the checkpoint's own, not COCO's 80
    assert with_cat["seg_meta"] == {
        "classes": ["sky", "road", "tree"],
        "palette": [[0, 0, 255], [128, 64, 128], [0, 128, 0]],
    }
    assert with_cat["warnings"] == []  # mmdet says nothing of class names "not saved in the checkpoint"
    # import cat.mm adds names and changes nothing of the stack's: every stock call returns what it returns without
    # it (cat's safe loading, which drops the config mmengine would execute, is its own runs').
    assert with_cat == plain


class _ObjectArrayByConstructor:
    """Pickles as ``numpy.ndarray((2,), 'O')``: an object array made by a call of an allowed global."""

    def __reduce__(self):
        return (np.ndarray, ((2,), "O"))  # the dtype by its name: no dtype object, no reconstruction


def test_plain_fields_stay_and_code_that_would_run_is_refused_or_dropped(tmp_path):
    checkpoint = tmp_path / "stock.pth"
    meta = {"CLASSES": ("a",), "PALETTE": np.array([[1, 2, 3]], dtype=np.uint8), "scale": np.float16(0.5)}
    meta |= {"names": np.array(["a", "b"]), "config": "import os", "cfg": "import os"}
    hub = {"runtime_info": {"cfg": "import os", "epoch": 3}}
    torch.save({"meta": meta, "message_hub": hub, "state_dict": {"w": torch.zeros(2)}}, checkpoint)
    loaded = load_from_safe_local(str(checkpoint))
    assert loaded["meta"]["CLASSES"] == ("a",) and loaded["meta"]["PALETTE"].tolist() == [[1, 2, 3]]
    assert loaded["meta"]["names"].tolist() == ["a", "b"] and float(loaded["meta"]["scale"]) == 0.5
    assert not {"config", "cfg"} & set(loaded["meta"]) and loaded["message_hub"]["runtime_info"] == {"epoch": 3}
    # An object array unpickles anything: refused, naming its dtype (not the reconstructor every array uses).
    torch.save({"meta": {"x": np.array([1, "a", None], dtype=object)}, "state_dict": {}}, checkpoint)
    with pytest.raises(UnsafeCheckpointError, match="refused global 'numpy.dtypes.ObjectDType'$"):
        load_from_safe_local(str(checkpoint))
    # Nor one that numpy's allowed constructors make without a reconstruction (an ndarray of an object dtype).
    torch.save({"meta": {"x": _ObjectArrayByConstructor()}, "state_dict": {}}, checkpoint)
    with pytest.raises(UnsafeCheckpointError, match=r"holds a numpy array of Python objects \(dtype object\)$"):
        load_from_safe_local(str(checkpoint))
    # A missing file: what stock mmengine raises.
    with pytest.raises(FileNotFoundError, match=r"nothere.pth can not be found\.$"):
        load_from_safe_local(str(tmp_path / "nothere.pth"))
    assert sanitize_mm_checkpoint({"meta": {"epoch": 2, "CLASSES": ["x"]}}, "x.pth")["meta"] == {
        "epoch": 2,
        "CLASSES": ["x"],
    }
