"""Detection on the OpenMMLab stack: toy COCO training, Runner resume, COCO evaluation, presets."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cat.engine.dist import DistEnv
from tests.conftest import REPO, compose_config
from tests.mm.conftest import run_entry

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (CAT_SKIP_MM=1)")

DET_EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "det" / "experiment").glob("*.yaml"))
FAST = ["logger.wandb.mode=disabled", "log_interval=1", "batch_size=2"]


@pytest.mark.parametrize("experiment", ["toy_mask_rcnn_ca_pvt", "toy_mask_rcnn_ca_swin"])
def test_toy_train_checkpoint_resume_evaluate(experiment, toy_coco, tmp_path, run_tool):
    out = tmp_path / experiment
    run_entry("train_det.py", f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={out}",
              "schedule.epochs=1", *FAST)
    assert (out / "epoch_1.pth").is_file()
    # The checkpoint holds mmengine's HistoryBuffer: torch's weights-only loader refuses it unless
    # cat's allow-list is active (checked in a fresh interpreter).
    probe = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(out / 'epoch_1.pth')!r})"],
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "HistoryBuffer" in probe.stderr
    proc = run_entry("train_det.py", f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={out}",
                     "schedule.epochs=2", *FAST)
    assert "Auto resumed from the latest checkpoint" in proc.stdout + proc.stderr
    assert (out / "epoch_2.pth").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("bbox_mAP", "bbox_mAP_50", "bbox_mAP_75", "segm_mAP", "segm_mAP_50", "segm_mAP_75"):
        assert 0.0 <= metrics[key] <= 1.0
    # An evaluation run named like a Table 3 preset fills that row of tools/make_tables.py's Table 3.
    row_name = "mask_rcnn_ca_pvt_t_1x" if "pvt" in experiment else "mask_rcnn_ca_swin_t_1x"
    run_entry("train_det.py", f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={tmp_path / 'eval'}",
              "mode=eval", f"checkpoint={out / 'epoch_2.pth'}", f"name={row_name}", *FAST)
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["bbox_mAP"] == pytest.approx(metrics["bbox_mAP"])
    table = run_tool("make_tables", str(tmp_path / "eval"), "--table", "3")
    label = "CA-PVT-T" if "pvt" in experiment else "CA-Swin-T"
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    assert f"| {100 * metrics['bbox_mAP']:.2f} |" in row


def test_two_process_gloo(toy_coco, tmp_path):
    run_entry("train_det.py", f"data.root={toy_coco}", f"output_dir={tmp_path}", "schedule.epochs=1", *FAST, nproc=2)
    assert json.loads((tmp_path / "metrics.json").read_text())["bbox_mAP_50"] is not None


@pytest.mark.parametrize("experiment", DET_EXPERIMENTS)
def test_every_preset_builds_its_detector(experiment, toy_coco, tmp_path):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    from cat.mm import register_backbones
    from cat.mm.det import build_det_config

    register_all_modules()
    register_backbones()
    cfg = compose_config("det", f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={tmp_path}",
                      "logger.wandb.mode=disabled")
    mm = build_det_config(cfg, DistEnv(), str(tmp_path))
    with torch.device("meta"):
        detector = MODELS.build(mm.model)
    assert sum(p.numel() for p in detector.backbone.parameters()) > 5e6
    assert mm.model.backbone.model_name == cfg.model.backbone.name
    if experiment.endswith("3x"):
        assert mm.train_cfg.max_epochs == 36 and mm.train_pipeline[2]["type"] == "RandomChoiceResize"


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["mask_rcnn_ca_pvt_t_1x", "mask_rcnn_ca_swin_t_1x"])
def test_full_detector_forward_1333x800(experiment, toy_coco, tmp_path):
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmdet.utils import register_all_modules

    from cat.mm import register_backbones
    from cat.mm.det import build_det_config

    register_all_modules()
    register_backbones()
    cfg = compose_config("det", f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={tmp_path}")
    detector = MODELS.build(build_det_config(cfg, DistEnv(), str(tmp_path)).model).eval()
    sample = DetDataSample(metainfo={"img_shape": (800, 1333), "ori_shape": (800, 1333), "scale_factor": (1.0, 1.0),
                                     "batch_input_shape": (800, 1344)})
    image = torch.randint(0, 255, (3, 800, 1333), dtype=torch.uint8)
    with torch.no_grad():
        (result,) = detector.test_step({"inputs": [image], "data_samples": [sample]})
    assert result.pred_instances.bboxes.shape[1] == 4
    assert result.pred_instances.masks.shape[-2:] == (800, 1333)
