"""mmdet's and mmseg's own tools (the installed packages' tools/train.py, test.py, get_flops.py) on cat: the user
configs of configs/mm_user with their one custom_imports line, and a cat run folder's saved config and checkpoint
as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S
from tests.mm.conftest import run_entry

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out

mmdet = pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
mmseg = pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

USER_CONFIGS = REPO / "configs" / "mm_user"
FAST = ["logger.wandb.mode=disabled", "log_interval=1", "batch_size=2"]


def stock_tool(package, relative: str) -> Path:
    """A tool the installed package ships (``<package>/.mim/tools/...``), found from the package, not copied."""
    path = Path(package.__file__).parent / ".mim" / "tools" / relative
    assert path.is_file(), path
    return path


def run_stock(
    tool: Path, *args: str, cwd: Path, fresh: bool = False, check: bool = True
) -> subprocess.CompletedProcess:
    """``python TOOL ARGS``; ``fresh``: in a new interpreter that has imported nothing (what registers cat's
    components there is the config's custom_imports line alone), else forked from the prewarmed one; ``check``: it
    must succeed."""
    command = [sys.executable, str(tool), *args]
    runner = subprocess.run if fresh else prewarmed.run
    proc = runner(command, cwd=cwd, capture_output=True, text=True, timeout=TOY_RUN_S)
    assert proc.returncode == 0 or not check, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def tool_test_results(work_dir: Path) -> dict[str, float]:
    """The metrics a stock ``tools/test.py`` wrote (``<work_dir>/<timestamp>/<timestamp>.json``)."""
    (found,) = [p for p in work_dir.glob("*/*.json") if p.stem == p.parent.name]
    return json.loads(found.read_text())


def last_validation(work_dir: Path) -> dict[str, float]:
    """A stock ``tools/train.py`` run's last validation metrics (mmengine's ``vis_data/scalars.json``)."""
    (scalars,) = work_dir.glob("*/vis_data/scalars.json")
    entries = [json.loads(line) for line in scalars.read_text().splitlines()]
    return [e for e in entries if "lr" not in e][-1]


def loads_weights_only(checkpoint: Path) -> None:
    """The checkpoint loads in a bare ``torch.load`` (weights_only, torch's default) in a fresh interpreter."""
    code = f"import torch; c = torch.load({str(checkpoint)!r}); assert 'state_dict' in c and 'message_hub' in c"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def toy_det_config(tmp_path: Path, toy_coco: Path) -> Path:
    """The documented Mask R-CNN user config adapted to the toy COCO set, as a user adapts one to their data:
    its three classes, 128-pixel images, narrow heads, one short epoch."""
    config = tmp_path / "mask_rcnn_toy.py"
    config.write_text(
        f"""_base_ = {str(USER_CONFIGS / "mask_rcnn_ca_pvt_t_1x_coco.py")!r}
data_root = {str(toy_coco) + "/"!r}
metainfo = dict(classes=('circle', 'square', 'triangle'))
model = dict(  # the heads of train_det.py's toy experiment: it learns in 4 steps
    neck=dict(out_channels=64),
    rpn_head=dict(in_channels=64, feat_channels=64),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=64),
        bbox_head=dict(num_classes=3, in_channels=64, fc_out_channels=256),
        mask_roi_extractor=dict(out_channels=64),
        mask_head=dict(num_classes=3, in_channels=64, conv_out_channels=64),
    ),
)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
loader = dict(num_workers=0, persistent_workers=False)
dataset = dict(data_root=data_root, metainfo=metainfo)
train_dataloader = dict(batch_size=2, **loader, dataset=dict(**dataset, pipeline=train_pipeline))
val_dataloader = dict(**loader, dataset=dict(**dataset, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator
train_cfg = dict(max_epochs=1)
optim_wrapper = dict(optimizer=dict(lr=1e-3))
param_scheduler = [dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=20)]
"""
    )
    return config


def toy_seg_config(tmp_path: Path, toy_ade: Path) -> Path:
    """The documented UperNet user config adapted to the toy ADE20K set: 128-pixel crops, narrow heads, 4 steps."""
    config = tmp_path / "upernet_toy.py"
    config.write_text(
        f"""_base_ = {str(USER_CONFIGS / "upernet_ca_swin_t_160k_ade20k.py")!r}
data_root = {str(toy_ade)!r}
crop_size = (128, 128)
model = dict(data_preprocessor=dict(size=crop_size), decode_head=dict(channels=64), auxiliary_head=dict(channels=32))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(512, 128), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(512, 128), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
loader = dict(num_workers=0, persistent_workers=False)
train_dataloader = dict(batch_size=2, **loader, dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(**loader, dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=4, val_interval=4)
default_hooks = dict(checkpoint=dict(interval=4), logger=dict(interval=1))
optim_wrapper = dict(optimizer=dict(lr=1e-3))
param_scheduler = [dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=4)]
"""
    )
    return config


@pytest.mark.parametrize("task", ["det", "seg"])
def test_user_config_trains_and_tests_through_the_stock_tools(task, toy_coco, toy_ade, tmp_path):
    """A fresh interpreter: the stock train.py builds the cat backbone from the custom_imports line alone, its
    checkpoint loads in a bare torch.load, and the stock test.py on it gives the training's last validation."""
    package, checkpoint = (mmdet, "epoch_1.pth") if task == "det" else (mmseg, "iter_4.pth")
    config = toy_det_config(tmp_path, toy_coco) if task == "det" else toy_seg_config(tmp_path, toy_ade)
    run_stock(
        stock_tool(package, "train.py"), str(config), "--work-dir", str(tmp_path / "train"), cwd=tmp_path, fresh=True
    )
    loads_weights_only(tmp_path / "train" / checkpoint)
    run_stock(
        stock_tool(package, "test.py"),
        str(config),
        str(tmp_path / "train" / checkpoint),
        "--work-dir",
        str(tmp_path / "test"),
        cwd=tmp_path,
    )
    tested, validated = tool_test_results(tmp_path / "test"), last_validation(tmp_path / "train")
    metrics = [k for k in tested if k.startswith("coco/") or k in ("aAcc", "mIoU", "mAcc")]
    assert len(metrics) >= 3 and {k: tested[k] for k in metrics} == {k: validated[k] for k in metrics}


@pytest.mark.parametrize("task", ["det", "seg"])
def test_a_run_folders_saved_config_and_checkpoint_run_in_the_stock_tools(task, toy_coco, toy_ade, tmp_path):
    """train_det.py / train_seg.py's mm_config.py and checkpoint, unchanged: stock test.py reproduces the run's
    metrics.json, stock train.py trains it (writing its metrics through cat's backend into its own work_dir),
    stock browse_dataset.py draws its data, and nothing of any lands in the run folder."""
    out = tmp_path / "run"
    if task == "det":
        package, checkpoint = mmdet, "epoch_1.pth"
        run_entry(
            "train_det.py",
            "experiment=toy_mask_rcnn_ca_pvt",
            f"data.root={toy_coco}",
            f"output_dir={out}",
            "schedule.epochs=1",
            *FAST,
        )
        keys = {f"coco/{k}": k for k in ("bbox_mAP", "bbox_mAP_50", "bbox_mAP_75", "segm_mAP", "segm_mAP_50")}
    else:
        package, checkpoint = mmseg, "iter_3.pth"
        run_entry(
            "train_seg.py",
            "experiment=toy_fpn_ca_pvt",
            f"data.root={toy_ade}",
            f"output_dir={out}",
            "schedule.iters=3",
            "schedule.val_interval=3",
            "save.interval=3",
            *FAST,
        )
        keys = {k: k for k in ("aAcc", "mIoU", "mAcc")}
    before = sorted(p.name for p in out.iterdir())
    loads_weights_only(out / checkpoint)
    config = str(out / "mm_config.py")
    run_stock(
        stock_tool(package, "test.py"),
        config,
        str(out / checkpoint),
        "--work-dir",
        str(tmp_path / "test"),
        cwd=tmp_path,
    )
    recorded, tested = json.loads((out / "metrics.json").read_text()), tool_test_results(tmp_path / "test")
    assert any(recorded[k] for k in keys.values())  # a comparison of something, not of zeros only
    assert {k: tested[mm] for mm, k in keys.items()} == pytest.approx({k: recorded[k] for k in keys.values()})
    run_stock(stock_tool(package, "train.py"), config, "--work-dir", str(tmp_path / "train"), cwd=tmp_path)
    assert (tmp_path / "train" / checkpoint).is_file()
    (history,) = (tmp_path / "train").glob("*/vis_data/metrics.jsonl")
    assert any("loss" in json.loads(line) for line in history.read_text().splitlines())
    # The stock browse_dataset.py builds the config's visualizer without a save_dir (cat's metric backend refused
    # that) and draws each training image with its annotations. mmseg's then draws its labels into an array
    # OpenCV >= 4.8 refuses (mmseg issue #3405, with or without cat; OpenCV < 4.8 does not import with numpy 2).
    browse = stock_tool(package, "analysis_tools/browse_dataset.py")
    proc = run_stock(browse, config, "--not-show", "--output-dir", str(tmp_path / "browse"), cwd=tmp_path, check=False)
    assert "MetricSinkBackend" not in proc.stderr, proc.stderr[-3000:]
    if task == "det":
        assert proc.returncode == 0 and len(list((tmp_path / "browse").glob("*.jpg"))) == 8, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0 or "in function 'rectangle'" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == before


def test_get_flops_counts_a_cat_detector_as_tools_flops_does(toy_coco, tmp_path):
    """mmdet's analysis_tools/get_flops.py (jit-traced with gradients on, the default lean_attention) on the
    Mask R-CNN user config, at the toy images' 800x800 input: its count (the raw number behind the tool's two
    printed digits, recorded from mmengine's get_model_complexity_info as the tool calls it) within 2% of
    tools/flops.py's for the same model."""
    probe = f"""
import json, runpy, sys
import mmengine.analysis as analysis
counts, original = [], analysis.get_model_complexity_info
def recording(*args, **kwargs):
    result = original(*args, **kwargs)
    counts.append(result["flops"])
    return result
analysis.get_model_complexity_info = recording
sys.argv = ["get_flops.py", {str(USER_CONFIGS / "mask_rcnn_ca_pvt_t_1x_coco.py")!r}, "--num-images", "1",
            "--cfg-options", "val_dataloader.dataset.data_root={toy_coco}/", "val_dataloader.num_workers=0",
            "val_dataloader.persistent_workers=False"]
runpy.run_path({str(stock_tool(mmdet, "analysis_tools/get_flops.py"))!r}, run_name="__main__")
print("COUNTS", json.dumps(counts))
"""
    proc = prewarmed.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=TOY_RUN_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Input shape: (800, 800)" in proc.stdout
    (mmengine_count,) = json.loads(proc.stdout.split("COUNTS", 1)[1])
    ours = json.loads(
        run_stock(
            REPO / "tools" / "flops.py",
            "--det",
            "mask_rcnn_ca_pvt_t_1x",
            "--img-size",
            "800",
            "800",
            "--json",
            cwd=REPO,
        ).stdout
    )[0]["flops"]
    assert mmengine_count == pytest.approx(ours, rel=0.02)
