"""Detection on the OpenMMLab stack: toy COCO training, Runner resume, COCO evaluation, presets."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml

from cat.runtime.confine import abi_version
from cat.runtime.dist import DistEnv
from cat.runtime.metric_sinks import read_history
from tests import prewarmed
from tests.conftest import REPO, compose_config, mm_builder, refusal_line, run_folder
from tests.entry_cases import run_entry_cases
from tests.mm.conftest import run_entry, stop_like_slurm

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

DET_EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "det" / "experiment").glob("*.yaml"))
FAST = ["logger.wandb.mode=disabled", "log_interval=1", "batch_size=2"]


@pytest.mark.parametrize("experiment", ["toy_mask_rcnn_ca_pvt", "toy_mask_rcnn_ca_swin"])
def test_toy_train_checkpoint_resume_evaluate(experiment, toy_coco, tmp_path, run_tool):
    out = tmp_path / experiment
    run_entry(
        "train_det.py",
        f"experiment={experiment}",
        f"data.root={toy_coco}",
        f"output_dir={out}",
        "schedule.epochs=1",
        *FAST,
    )
    assert (out / "epoch_1.pth").is_file()
    # One mmengine config in the run folder, named for the run, that describes it.
    assert [p.name for p in out.glob("*.py")] == ["mm_config.py"]
    from mmengine.config import Config

    dumped = Config.fromfile(out / "mm_config.py")
    # For the stock tools: it imports cat.mm, names no work_dir (they write into theirs) and resumes only when asked.
    assert dumped.model.backbone.type == "TimmBackbone" and dumped.custom_imports.imports == ["cat.mm"]
    assert "work_dir" not in dumped and dumped.resume is False
    # The message hub's HistoryBuffers were written as plain data: torch's weights-only loader reads the file with
    # no allow-list (a fresh interpreter); cat's loader makes them HistoryBuffers again for the resume below. The
    # checkpoint carries the run's config as config.yaml has it: what a resume compares against.
    code = f"import json, torch; c = torch.load({str(out / 'epoch_1.pth')!r}); print(type(c['meta']))"
    code += "; print(json.dumps(c['config']))"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert probe.returncode == 0 and "dict" in probe.stdout.splitlines()[0], probe.stderr
    assert json.loads(probe.stdout.splitlines()[1]) == yaml.safe_load((out / "config.yaml").read_text())
    proc = run_entry(
        "train_det.py",
        f"experiment={experiment}",
        f"data.root={toy_coco}",
        f"output_dir={out}",
        "schedule.epochs=2",
        *FAST,
    )
    assert "Auto resumed from the latest checkpoint" in proc.stdout + proc.stderr
    assert "is not HistoryBuffer" not in proc.stdout + proc.stderr  # the plain buffers were restored, not skipped
    assert (out / "epoch_2.pth").is_file()
    # A resume with another learning rate would run the checkpoint's (mmengine restores its optimizer): refused,
    # and the run's record stays as it was.
    record = (out / "config.yaml").read_text()
    args = [f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={out}", "schedule.epochs=3", *FAST]
    refused = run_entry_cases("train_det.py", {"lr": [*args, "schedule.optim.lr=5e-4"]})["lr"]
    assert refused.returncode == 2 and "with a different schedule.optim.lr: 0.001 -> 0.0005" in refused.stderr
    assert (out / "config.yaml").read_text() == record and not (out / "epoch_3.pth").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("bbox_mAP", "bbox_mAP_50", "bbox_mAP_75", "segm_mAP", "segm_mAP_50", "segm_mAP_75"):
        assert 0.0 <= metrics[key] <= 1.0
    # The metric history, through cat's sink: training losses every log_interval, the validation
    # metrics at their iteration, and the final test, one step axis across the resume.
    history = read_history(out / "metrics.jsonl")
    train = [e for e in history if "loss" in e and "lr" in e]
    val = [e for e in history if "coco/bbox_mAP" in e]
    assert len(train) >= 2 and len(val) == 2 and val[-1]["step"] == train[-1]["step"]
    assert history[-1]["test/bbox_mAP"] == pytest.approx(metrics["bbox_mAP"])
    # An evaluation run named like a Table 3 preset fills that row of tools/make_tables.py's Table 3.
    row_name = "mask_rcnn_ca_pvt_t_1x" if "pvt" in experiment else "mask_rcnn_ca_swin_t_1x"
    run_entry(
        "train_det.py",
        f"experiment={experiment}",
        f"data.root={toy_coco}",
        f"output_dir={tmp_path / 'eval'}",
        "mode=eval",
        f"checkpoint={out / 'epoch_2.pth'}",
        f"name={row_name}",
        *FAST,
    )
    evaluated = json.loads((tmp_path / "eval" / "eval" / "metrics.json").read_text())
    assert evaluated["bbox_mAP"] == pytest.approx(metrics["bbox_mAP"])
    table = run_tool("make_tables", str(tmp_path / "eval"), "--table", "3")
    label = "CA-PVT-T" if "pvt" in experiment else "CA-Swin-T"
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    assert f"| {100 * metrics['bbox_mAP']:.2f} |" in row


def test_two_process_gloo(toy_coco, tmp_path):
    """Two processes, each accumulating two iterations per optimizer step (DDP's no_sync inside), confined by the
    kernel: the ranks gather their validation results in the run folder (mmengine's default is a .dist_test/ in the
    working directory, which a confined run may not write), and nothing is left there."""
    stray = REPO / ".dist_test"
    before = stray.exists()
    run_entry(
        "train_det.py",
        f"data.root={toy_coco}",
        f"output_dir={tmp_path}",
        "schedule.epochs=1",
        "accum_steps=2",
        *FAST,
        nproc=2,
    )
    assert json.loads((tmp_path / "metrics.json").read_text())["bbox_mAP_50"] is not None
    assert stray.exists() == before and not (tmp_path / ".dist_test").exists()
    if abi_version() > 0:
        assert "writes confined by the kernel" in (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize("experiment", DET_EXPERIMENTS)
def test_every_preset_builds_its_detector(experiment, toy_coco, tmp_path):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    from cat.mm.backbone import register_backbones

    register_all_modules()
    register_backbones()
    cfg = compose_config(
        "det",
        f"experiment={experiment}",
        f"data.root={toy_coco}",
        f"output_dir={tmp_path}",
        "logger.wandb.mode=disabled",
    )
    mm = mm_builder("det")(cfg, DistEnv(), str(tmp_path))
    with torch.device("meta"):
        detector = MODELS.build(mm.model)
    assert sum(p.numel() for p in detector.backbone.parameters()) > 5e6
    assert mm.model.backbone.model_name == cfg.model.backbone.name
    if experiment.endswith("3x"):
        assert mm.train_cfg.max_epochs == 36 and mm.train_pipeline[2]["type"] == "RandomChoiceResize"


@pytest.mark.parametrize(
    "base, heads",
    [
        ("retinanet/retinanet_r18_fpn_1x_coco.py", ["bbox_head"]),  # single-stage: no roi_head (was AttributeError)
        ("cascade_rcnn/cascade-mask-rcnn_r50_fpn_1x_coco.py", ["roi_head.bbox_head", "roi_head.mask_head"]),
        ("htc/htc_r50_fpn_1x_coco.py", ["roi_head.bbox_head", "roi_head.mask_head"]),
    ],
)
def test_a_class_subset_reaches_whatever_heads_a_stock_detector_has(base, heads, toy_coco, tmp_path):
    """A stock detector through train_det.py '~experiment' model.base=... on a class subset (data=toy_coco): every
    head that classifies into the dataset's classes takes its count, lists of them (a cascade's stages) too; the
    region proposals' and HTC's semantic head (stuff classes) keep theirs; the detector builds."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    register_all_modules()
    cfg = compose_config(
        "det", "~experiment", f"model.base=mmdet::{base}", "data=toy_coco", f"data.root={toy_coco}",
        f"output_dir={tmp_path}", "logger.wandb.mode=disabled",
    )  # fmt: skip
    classes = len(cfg.data.classes)
    mm = mm_builder("det")(cfg, DistEnv(), str(tmp_path))
    for path in heads:
        node = mm.model
        for part in path.split("."):
            node = node[part]
        for head in node if isinstance(node, list) else [node]:
            assert head["num_classes"] == classes, (path, head["num_classes"])
    if "htc" in base:
        assert mm.model.roi_head.semantic_head.num_classes == 183
    with torch.device("meta"):
        MODELS.build(mm.model)


@pytest.mark.parametrize("lean", [True, False])
def test_backbone_lean_attention_switch_reaches_every_attention(lean, toy_coco, tmp_path):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    from cat.mm.backbone import register_backbones
    from cat.ops import CirculantAttention

    register_all_modules()
    register_backbones()
    overrides = [f"data.root={toy_coco}", f"output_dir={tmp_path}", "logger.wandb.mode=disabled"]
    cfg = compose_config("det", "experiment=toy_mask_rcnn_ca_pvt", *overrides, f"model.backbone.lean_attention={lean}")
    detector = MODELS.build(mm_builder("det")(cfg, DistEnv(), str(tmp_path)).model)
    attentions = [m for m in detector.backbone.modules() if isinstance(m, CirculantAttention)]
    assert attentions and all(m.lean is lean for m in attentions)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["mask_rcnn_ca_pvt_t_1x", "mask_rcnn_ca_swin_t_1x"])
def test_full_detector_forward_1333x800(experiment, toy_coco, tmp_path):
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmdet.utils import register_all_modules

    from cat.mm.backbone import register_backbones

    register_all_modules()
    register_backbones()
    cfg = compose_config("det", f"experiment={experiment}", f"data.root={toy_coco}", f"output_dir={tmp_path}")
    detector = MODELS.build(mm_builder("det")(cfg, DistEnv(), str(tmp_path)).model).eval()
    sample = DetDataSample(
        metainfo={
            "img_shape": (800, 1333),
            "ori_shape": (800, 1333),
            "scale_factor": (1.0, 1.0),
            "batch_input_shape": (800, 1344),
        }
    )
    image = torch.randint(0, 255, (3, 800, 1333), dtype=torch.uint8)
    with torch.no_grad():
        (result,) = detector.test_step({"inputs": [image], "data_samples": [sample]})
    assert result.pred_instances.bboxes.shape[1] == 4
    assert result.pred_instances.masks.shape[-2:] == (800, 1333)


def test_sigterm_saves_the_iteration_and_the_rerun_resumes_there(tmp_path_factory, tmp_path):
    """SIGTERM to the trainer and every process below it (its DataLoader workers), as Slurm signals a
    job step: the trainer still finishes the iteration, and with ``accum_steps`` the rest of the accumulation
    (its gradients are in no checkpoint), and saves it."""
    root = tmp_path_factory.mktemp("coco24")
    prewarmed.run(
        [sys.executable, str(REPO / "tools" / "make_toy_coco.py"), str(root), "--train", "24", "--val", "4"],
        check=True,
        capture_output=True,
    )
    out = tmp_path / "run"
    args = [f"data.root={root}", f"output_dir={out}", "schedule.epochs=1", "workers=2", "accum_steps=4", *FAST]
    status, stderr = stop_like_slurm("train_det.py", args, out / "log.txt", r"Epoch\(train\) +\[1\]\[ *1/12\]")
    assert status == 0, stderr[-3000:]
    stopped = json.loads((out / "metrics.json").read_text())
    assert stopped["preempted"] is True and stopped["iteration"] in (4, 8)  # the end of an accumulation
    saved = out / f"iter_{stopped['iteration']}.pth"
    assert saved.is_file() and (out / "last_checkpoint").read_text() == str(saved)
    assert not list(out.glob(".cat-tmp-*"))
    proc = run_entry(
        "train_det.py", f"data.root={root}", f"output_dir={out}", "schedule.epochs=1", "accum_steps=4", *FAST
    )
    log = proc.stdout + proc.stderr
    assert "Resumed iteration number is not divisible" not in log  # mmengine's warning: gradients lost
    done = stopped["iteration"]
    assert f"resuming epoch 1 at iteration {done + 1} of 12: skipping the {done} batches it trained" in log
    trained = re.findall(r"Epoch\(train\) +\[1\]\[ *(\d+)/12\]", log)
    assert trained[0] == str(done + 1) and trained[-1] == "12" and len(trained) == 12 - done
    assert json.loads((out / "metrics.json").read_text())["bbox_mAP"] is not None


# pycocotools prints it as each of the run's datasets reads its annotations (a minute for COCO's train set).
DATA_LOADING = "loading annotations into memory"


def test_backbone_weights_of_another_model_are_refused_before_the_data_loads(toy_coco, tmp_path):
    """model.pretrained of another size (CA-PVT-S's for CA-PVT-T) under strict_load: one line naming the file
    and the keys, before the datasets are built (mmengine reads the backbone's weights only after them)."""
    import cat

    other = tmp_path / "ca_pvt_small.pth"
    torch.save(cat.create_model("ca_pvt_small").state_dict(), other)
    args = [f"data.root={toy_coco}", f"output_dir={tmp_path / 'run'}", f"model.pretrained={other}", *FAST]
    proc = run_entry_cases("train_det.py", {"other size": args})["other size"]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: checkpoint {other} does not match the model (a ca_pvt_tiny backbone" in proc.stderr
    assert "unexpected in checkpoint (131): block1.2.cpe.weight" in proc.stderr
    assert DATA_LOADING not in proc.stdout + proc.stderr and not list((tmp_path / "run").glob("*.pth"))


HOSTILE_REFUSALS = {"getattr_chain": "getattr", "zip_torch": "system", "build_on_class": "BUILD on the class"}


def test_hostile_checkpoints_are_refused_everywhere(toy_coco, tmp_path):
    """Each hostile file as pretrained weights, as the checkpoint to evaluate, and as the run's
    last checkpoint to resume from: one line each, and the payload never fires."""
    from tests.hostile import write_hostile_files

    marker = tmp_path / "MARKER"
    files = write_hostile_files(tmp_path / "files", marker)
    cases = {}
    for name in HOSTILE_REFUSALS:
        resume_dir = tmp_path / name / "resume"
        run_folder(resume_dir)
        (resume_dir / "epoch_1.pth").write_bytes(files[name].read_bytes())
        (resume_dir / "last_checkpoint").write_text(str(resume_dir / "epoch_1.pth"))
        common = [f"data.root={toy_coco}", *FAST]
        cases[name, "pretrained"] = [*common, f"model.pretrained={files[name]}", f"output_dir={tmp_path / name / 'a'}"]
        if name == next(iter(HOSTILE_REFUSALS)):  # a lenient load reads the file as early
            lenient = [*common, "strict_load=false", f"model.pretrained={files[name]}"]
            cases[name, "pretrained, lenient"] = [*lenient, f"output_dir={tmp_path / name / 'c'}"]
        cases[name, "eval"] = [*common, "mode=eval", f"checkpoint={files[name]}", f"output_dir={tmp_path / name / 'b'}"]
        cases[name, "resume"] = [*common, f"output_dir={resume_dir}"]
    runs = run_entry_cases("train_det.py", {f"{name}/{case}": args for (name, case), args in cases.items()})
    for name, case in cases:
        last = refusal_line(runs[f"{name}/{case}"])
        assert last.startswith("error: refusing to load checkpoint") and HOSTILE_REFUSALS[name] in last, (
            name,
            case,
            last,
        )
        if case.startswith("pretrained"):  # refused before the datasets are built
            assert DATA_LOADING not in runs[f"{name}/{case}"].stdout, name
    assert not marker.exists() and not (tmp_path / "MARKER.patch").exists()
