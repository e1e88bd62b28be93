"""The Hydra -> mmengine bridge refuses bad input with errors that name the problem."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch

from cat.errors import ConfigError, DataError
from cat.runtime.dist import DistEnv
from cat.runtime.resume import START_OVER
from tests.conftest import as_typed, checked_config, compose_config, mm_builder, refusal_line, typed_config
from tests.entry_cases import run_entry_cases

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")


@pytest.mark.parametrize(("task", "layout"), [("det", "COCO layout"), ("seg", "ADE20K layout")])
@pytest.mark.parametrize("root", [None, "missing"])
def test_missing_data_root(task, layout, root, tmp_path):

    data_root = "null" if root is None else str(tmp_path / root)
    cfg = compose_config(task, f"data.root={data_root}", f"output_dir={tmp_path}", "logger.wandb.mode=disabled")
    build = mm_builder(task)
    with pytest.raises(DataError, match=layout) as error:
        build(cfg, DistEnv(), str(tmp_path))
    assert f"data.root={None if root is None else str(tmp_path / root)!r}" in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["det", "seg"])
def test_relative_data_root_reads_the_data(task, toy_coco, toy_ade, tmp_path, monkeypatch):
    """The README's toy commands pass data.root relative to the working directory: every split's dataset
    reads its samples from there (mmengine joined an already-joined annotation path to data_root again),
    and the dumped config names the data by its absolute path."""
    from mmdet.utils import register_all_modules as register_det
    from mmengine.registry import DATASETS
    from mmseg.utils import register_all_modules as register_seg

    data = toy_coco if task == "det" else toy_ade
    monkeypatch.chdir(data.parent)
    cfg = compose_config(task, f"data.root={data.name}", f"output_dir={tmp_path}", "logger.wandb.mode=disabled")
    (register_det if task == "det" else register_seg)(init_default_scope=True)
    mm = mm_builder(task)(cfg, DistEnv(), str(tmp_path))
    for loader, count in (("train_dataloader", 8), ("val_dataloader", 4), ("test_dataloader", 4)):
        assert len(DATASETS.build(mm[loader].dataset)) == count
        assert mm[loader].dataset.data_root == str(data)
    if task == "det":
        assert Path(mm.val_evaluator.ann_file).is_file() and Path(mm.val_evaluator.ann_file).is_absolute()


@pytest.mark.slow  # the toy datasets' processes
@pytest.mark.parametrize(
    ("task", "overrides", "repeats"),
    [
        ("det", [], True),
        ("seg", [], True),
        ("seg", ["experiment=fpn_ca_pvt_t_40k"], True),
        ("seg", ["mode=eval", "tta=true"], False),  # the test reads flipped, rescaled images
    ],
)
def test_the_final_test_is_skipped_only_where_it_repeats_the_validation(
    task, overrides, repeats, toy_coco, toy_ade, tmp_path
):
    from cat.mm.validation import test_repeats_validation

    root = toy_coco if task == "det" else toy_ade
    cfg = compose_config(task, f"data.root={root}", f"output_dir={tmp_path}", "logger.wandb.mode=disabled", *overrides)
    mm = mm_builder(task)(cfg, DistEnv(), str(tmp_path))
    assert test_repeats_validation(mm) is repeats
    mm.test_evaluator["type"] = "Another"
    assert not test_repeats_validation(mm)


BAD_KEYS = [
    ("det", "strict_load=maybe", "strict_load='maybe': expected true or false"),
    ("seg", "strict_load=maybe", "strict_load='maybe': expected true or false"),
    ("det", "model.backbone.drop_path_rate=2", "model.backbone.drop_path_rate=2: expected a number >= 0 and <= 1"),
    (
        "seg",
        "model.backbone.lean_attention=maybe",
        "model.backbone.lean_attention='maybe': expected one of auto, True, False",
    ),
    ("det", "accum_steps=0", "accum_steps=0: expected an integer >= 1"),
    (
        "det",
        "model.backbone.fft_backend=cufft",
        "model.backbone.fft_backend='cufft': expected one of auto, fft, separable, matmul",
    ),
    ("seg", "model.backbone.attention_memory_mb=-1", "model.backbone.attention_memory_mb=-1: expected an integer >= 1"),
    (
        "seg",
        "model.backbone.grad_checkpointing=maybe",
        "model.backbone.grad_checkpointing='maybe': expected true or false",
    ),
    ("det", "++model.backbone.kwargs.foo=1", "model.backbone.kwargs.foo: not an argument of ca_pvt_tiny (accepted:"),
    ("det", "schedule.epoch=3", "schedule.epoch: not a key of this config (known here: epochs, optim,"),
    ("seg", "model=upernet_ca_swin_tiy", "model=upernet_ca_swin_tiy: no such option (available:"),
    ("det", "schedule.epochs=1000000", "schedule.epochs=1000000: expected an integer >= 1 and <= 100000"),
    ("seg", "schedule.iters=10000000000", "schedule.iters=10000000000: expected an integer >= 1 and <= 1e+09"),
    ("det", "schedule.optim.lr=1e7", "schedule.optim.lr=10000000.0: expected a number > 0 and <= 1e+06"),
    ("seg", "data.classes=[]", "data.classes=[]: name one class or more, or null for all of the dataset's"),
    # Where mmengine writes is checked where it lands, by the runner's final config: tests/mm/test_writes.py.
]


@pytest.fixture(scope="module")
def bad_key_runs(tmp_path_factory) -> tuple[Path, dict[tuple[str, str], subprocess.CompletedProcess]]:
    """Every BAD_KEYS run, the ones of a task in one interpreter (``tests.entry_cases``)."""
    root = tmp_path_factory.mktemp("bad_keys")
    runs = {}
    for task in ("det", "seg"):
        (root / "data").mkdir(exist_ok=True)
        cases = {
            o: [f"data.root={root / 'data'}", f"output_dir={root / 'run'}", o] for t, o, _ in BAD_KEYS if t == task
        }
        runs.update({(task, o): proc for o, proc in run_entry_cases(f"train_{task}.py", cases).items()})
    return root, runs


@pytest.mark.slow
@pytest.mark.parametrize(("task", "override", "expected"), BAD_KEYS, ids=[f"{t}-{o}" for t, o, _ in BAD_KEYS])
def test_bad_key_is_one_line(task, override, expected, bad_key_runs):
    """An invalid value is one line, exit 2, and no folder is made."""
    root, runs = bad_key_runs
    assert expected in refusal_line(runs[task, override])
    assert not (root / "run").exists()


BACKBONE_LEVELS = [
    (
        "det",
        "model.backbone.name=resnet18",
        "resnet18's maps there have strides [2, 4, 8, 16], but the heads are built for strides [4, 8, 16, 32] "
        "(roi_head.bbox_roi_extractor.featmap_strides); out_indices=[1, 2, 3, 4] give those",
    ),
    ("seg", "model.backbone.name=resnet18", "(decode_head.feature_strides); out_indices=[1, 2, 3, 4] give those"),
    ("det", "model.backbone.out_indices=[0,1,2,7]", "ca_pvt_tiny has 4 feature levels, strides [4, 8, 16, 32]"),
    (
        "seg",
        "model.backbone.out_indices=[1,2,3]",
        "strides [8, 16, 32], but the heads are built for strides [4, 8, 16, 32]",
    ),
]


@pytest.mark.parametrize(("task", "override", "expected"), BACKBONE_LEVELS)
def test_backbone_levels_must_match_the_heads(task, override, expected, tmp_path):
    """mmdet's RoI extractors and SemanticFPN's head take their strides from the config, not from the maps:
    a timm ResNet's first four levels (strides 2-16) trained a toy detector to bbox_mAP_50 0.0 where its levels
    1-4 reach 0.16. Refused with the indices that fit; an index past the last level is named (it was an
    IndexError). The fitting indices pass, as do UperNet's heads, which name no strides."""

    (tmp_path / "data").mkdir()
    common = [f"data.root={tmp_path / 'data'}", f"output_dir={tmp_path / 'run'}", "logger.wandb.mode=disabled"]
    with pytest.raises(ConfigError) as refused:
        checked_config(task, *common, override)
    (problem,) = refused.value.problems
    assert problem.startswith("model.backbone.out_indices=") and expected in problem, problem
    if "resnet18" in override:
        checked_config(task, *common, override, "model.backbone.out_indices=[1,2,3,4]")
    checked_config("seg", *common, "experiment=toy_upernet_ca_swin", "model.backbone.name=resnet18")


@pytest.mark.parametrize(
    "base", ["mmdet::retinanet/retinanet_r18_fpn_1x_coco.py", "mmdet::fcos/fcos_r50-caffe_fpn_gn-head_1x_coco.py"]
)
def test_a_single_stage_detectors_config_is_checked_without_a_crash(base, tmp_path):
    """A stock single-stage detector (no RoI head, no decode head) as model.base: its checks ran into
    SemanticFPN's decode_head ('ConfigDict' object has no attribute ...) on the way to eval or train. With the
    default preset (the toy Mask R-CNN) left in, its overrides name heads this detector lacks: refused, where the
    model's build raised a bare KeyError ("... must contain the key 'type'")."""
    (tmp_path / "data").mkdir()
    common = [f"data.root={tmp_path / 'data'}", f"output_dir={tmp_path / 'run'}", f"model.base={base}"]
    assert checked_config("det", *common, "~experiment").model.base == base
    with pytest.raises(ConfigError) as refused:
        checked_config("det", *common)
    (problem,) = refused.value.problems
    assert f"{base} has no model.roi_head.bbox_head" in problem and "leave the preset out with '~experiment'" in problem


@pytest.mark.parametrize("task", ["det", "seg"])
def test_resume_refuses_what_mmengine_would_not_apply(task, tmp_path, caplog):
    """mmengine's resume puts the checkpoint's optimizer and schedulers over the config's: a changed rate or
    milestone would silently not apply, and another model crashed in the optimizer's state. Refused by
    name, before anything is written; a longer run, moved data and the same math computed another way are
    taken and logged. Without a checkpoint to resume, the folder starts over."""

    from cat.mm.runner import check_resume_config
    from cat.mm.safe_load import install_safe_checkpoint_io
    from cat.runtime import RunFolder

    length = "schedule.epochs=24" if task == "det" else "schedule.iters=80000"
    folder = RunFolder(str(tmp_path), logging.getLogger("test_resume"), is_main=True)
    base = compose_config(task, "data.root=/data/a", "logger.wandb.mode=disabled")
    folder.write_config(as_typed(base, task))
    changed = compose_config(
        task, "data.root=/data/a", "logger.wandb.mode=disabled", "schedule.optim.lr=5e-4", "seed=7", "batch_size=8"
    )
    check_resume_config(as_typed(changed, task), folder)  # no last_checkpoint: nothing to resume
    install_safe_checkpoint_io()
    # A checkpoint saved before checkpoints recorded their config: the folder's config.yaml is compared.
    torch.save({"meta": {"epoch": 1, "iter": 8}, "state_dict": {}}, tmp_path / "iter_8.pth")
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "iter_8.pth"))
    with pytest.raises(ConfigError) as refused:
        check_resume_config(as_typed(changed, task), folder)
    assert [line.split(" with a different ")[1] for line in refused.value.problems[:3]] == [
        f"batch_size: {base.batch_size} -> 8",
        f"schedule.optim.lr: {base.schedule.optim.lr!r} -> 0.0005",
        f"seed: {base.seed} -> 7",
    ]
    assert refused.value.problems[0].startswith(f"cannot resume {tmp_path / 'iter_8.pth'} ")
    free = ("data.root=/data/b", "model.backbone.lean_attention=true", length, "logger.wandb.mode=disabled")
    with caplog.at_level(logging.INFO, logger="test_resume"):
        check_resume_config(typed_config(task, *free), folder)
    assert "data.root: '/data/a' -> '/data/b'" in caplog.text
    assert (
        f"{length.split('=')[0]}: " in caplog.text and "the steps added run at the rate where they ended" in caplog.text
    )


@pytest.mark.parametrize(
    ("task", "saved", "meta", "length", "refusal"),
    [
        ("seg", "iter_4.pth", {"epoch": 0, "iter": 4}, 3, "has trained 4 iterations"),
        ("seg", "iter_4.pth", {"epoch": 0, "iter": 4}, 4, None),
        ("seg", "renamed.pth", {"epoch": 0, "iter": 4}, 3, "has trained 4 iterations"),
        ("seg", "renamed.pth", None, 3, None),  # no meta: not mmengine's checkpoint, its resume says so
        ("det", "epoch_2.pth", {"epoch": 2, "iter": 24}, 1, "has trained 2 epochs"),
        ("det", "iter_13.pth", {"epoch": 1, "iter": 13}, 1, "has begun epoch 2"),  # a mid-epoch (preemption) save
        ("det", "iter_13.pth", {"epoch": 1, "iter": 13}, 2, None),
    ],
)
def test_resume_refuses_a_schedule_shorter_than_trained(task, saved, meta, length, refusal, tmp_path):
    """mmengine's loop would end at once, and the record would claim the shorter run."""
    from cat.mm.runner import check_resume_config
    from cat.mm.safe_load import install_safe_checkpoint_io
    from cat.runtime import RunFolder

    install_safe_checkpoint_io()
    key = "schedule.epochs" if task == "det" else "schedule.iters"
    folder = RunFolder(str(tmp_path), logging.getLogger("test_resume"), is_main=True)
    folder.write_config(typed_config(task, "data.root=/data/a", f"{key}=30000"))
    torch.save({"meta": meta, "state_dict": {}}, tmp_path / saved)
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / saved))
    shorter = compose_config(task, "data.root=/data/a", f"{key}={length}")
    if refusal is None:
        check_resume_config(as_typed(shorter, task), folder)
        return
    with pytest.raises(ConfigError) as refused:
        check_resume_config(as_typed(shorter, task), folder)
    assert refused.value.problems == [
        f"{key}={length}: {tmp_path / saved} {refusal}; a shorter run needs another output_dir (or {START_OVER})"
    ]


def test_the_schedule_check_reads_a_hostile_checkpoint_safely(tmp_path):
    """A renamed last checkpoint is read for how far it got (a shorter schedule asked for): through the safe loader,
    so a hostile file runs nothing and is refused by name."""
    from cat.errors import CheckpointError
    from cat.mm.runner import check_resume_config
    from cat.mm.safe_load import install_safe_checkpoint_io
    from cat.runtime import RunFolder
    from tests.hostile import write_hostile_files

    install_safe_checkpoint_io()
    marker = tmp_path / "MARKER"
    hostile = write_hostile_files(tmp_path / "files", marker)["plain_pickle"]
    folder = RunFolder(str(tmp_path), logging.getLogger("test_resume"), is_main=True)
    folder.write_config(typed_config("seg", "data.root=/data/a", "schedule.iters=30000"))
    (tmp_path / "last_checkpoint").write_text(str(hostile))
    with pytest.raises(CheckpointError, match=str(hostile)):
        check_resume_config(typed_config("seg", "data.root=/data/a", "schedule.iters=3"), folder)
    assert not marker.exists()


def test_resume_refuses_a_broken_or_hostile_run_config(tmp_path):
    """The run folder's config.yaml is read before a resume: a YAML tag that would run code runs nothing, and
    that file, a truncated one, binary bytes or a list are each refused in one line naming it; nothing is
    written."""

    from cat.mm.runner import check_resume_config
    from cat.mm.safe_load import install_safe_checkpoint_io
    from cat.runtime import RunFolder

    install_safe_checkpoint_io()
    marker = tmp_path / "MARKER"
    contents = {
        "hostile": f"model: !!python/object/apply:os.system ['touch {marker}']\n".encode(),
        "truncated": b"model:\n  backbone: {name: ca_pvt_tiny\n",
        "binary": bytes(range(256)),
        "list": b"- model\n- data\n",
    }
    cfg = compose_config("det", f"data.root={tmp_path}", "logger.wandb.mode=disabled")
    for name, content in contents.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.yaml").write_bytes(content)
        torch.save({"meta": {"epoch": 1, "iter": 12}, "state_dict": {}}, folder / "epoch_1.pth")  # no config in it
        (folder / "last_checkpoint").write_text(str(folder / "epoch_1.pth"))
        with pytest.raises(ConfigError) as refused:
            check_resume_config(
                as_typed(cfg, "det"), RunFolder(str(folder), logging.getLogger("test_resume"), is_main=True)
            )
        (problem,) = refused.value.problems
        assert problem.startswith(f"{folder / 'config.yaml'} is not the config a run wrote ("), (name, problem)
        assert (folder / "config.yaml").read_bytes() == content
    assert not marker.exists()


def test_apply_common_settings(toy_coco, tmp_path):
    """What every det/seg job shares, read off the mmengine config cat builds."""

    cfg = compose_config(
        "det",
        f"data.root={toy_coco}",
        "seed=7",
        "save.keep_last=2",
        "log_interval=3",
        "++mm.train_cfg.val_interval=2",
        "accum_steps=4",
        "model.backbone.grad_checkpointing=true",
    )
    mm = mm_builder("det")(cfg, DistEnv(), str(tmp_path))
    assert mm.optim_wrapper.accumulative_counts == 4 and mm.model.backbone.grad_checkpointing is True
    assert mm.work_dir == str(tmp_path) and mm.randomness == {"seed": 7, "deterministic": False}
    assert mm.launcher == "none" and mm.resume is True and mm.load_from is None
    assert mm.default_hooks.checkpoint.max_keep_ckpts == 2 and mm.default_hooks.checkpoint.save_last
    assert mm.default_hooks.logger == {"type": "LoggerHook", "interval": 3, "log_metric_by_epoch": False}
    assert mm.visualizer.vis_backends == [{"type": "MetricSinkBackend"}]  # the run's sinks, nothing else
    assert mm.train_cfg.type == "ResumableEpochBasedTrainLoop" and mm.train_cfg.val_interval == 2
    assert mm.optim_wrapper.type == "OptimWrapper"
    assert "SyncBN" not in str(mm.model)  # plain BN on CPU


def test_the_runner_config_is_formatted_once_for_each_content(toy_coco, tmp_path, monkeypatch):
    """The Runner reads ``pretty_text`` four times a run (and once more per checkpoint): yapf formats it once, to
    mmengine's own text, and again only when the config has changed."""
    import copy

    import mmengine.config.config as mm_config
    from mmengine.config import Config

    from cat.mm.config import RunnerConfig

    built = mm_builder("det")(compose_config("det", f"data.root={toy_coco}"), DistEnv(), str(tmp_path))
    mm = RunnerConfig(built.to_dict(), cfg_text=built.text, filename=str(tmp_path / "mm_config.py"))
    plain = Config(built.to_dict(), cfg_text=built.text, filename=str(tmp_path / "mm_config.py")).pretty_text
    formatted = []
    format_code = mm_config.FormatCode
    monkeypatch.setattr(mm_config, "FormatCode", lambda *a, **k: formatted.append(1) or format_code(*a, **k))
    runners = copy.deepcopy(mm)  # as Runner.from_cfg and Runner.__init__ take it
    assert isinstance(runners, RunnerConfig)
    assert [runners.pretty_text for _ in range(4)] == [plain] * 4 and len(formatted) == 1
    runners.default_hooks.logger.interval = 7
    assert "interval=7" in runners.pretty_text and len(formatted) == 2
    assert "interval=7" not in mm.pretty_text  # the copy's change is the copy's


def test_python_source_reads_back_as_the_config_it_was_made_from(toy_coco, tmp_path):
    """The dumped config's text: every value as it was (non-identifier keys, tuples, nested lists, long strings,
    None and booleans), laid out within the width where a value can break, its continuation lines under the
    opening bracket, for a whole detector's config as for a made-up one."""
    from mmengine.config import Config

    from cat.mm.config import python_source

    made_up = {
        "crop_size": (512, 512),
        "overrides": {"decode_head.channels": 64, "neck.in_channels": [64, 128, 320, 512]},
        "note": "a long string " * 12,
        "hooks": [{"type": "A", "interval": None, "by_epoch": False}, {"type": "B", "args": ((1, 2), [3.5, -1e-08])}],
        "empty": {},
    }
    built = mm_builder("det")(compose_config("det", f"data.root={toy_coco}"), DistEnv(), str(tmp_path)).to_dict()
    for config in (made_up, built):
        text = python_source(config, width=100)
        assert Config.fromstring(text, file_format=".py").to_dict() == config
        lines = text.splitlines()
        assert sum(len(line) > 100 for line in lines) <= sum("'/" in line for line in lines)  # only long paths
    text = python_source(made_up, width=60)
    start = text.index("hooks = [")
    assert text[start:].splitlines()[1].startswith(" " * len("hooks = [") + "{")


def test_amp_on_cpu_says_it_trains_in_float32(toy_coco, tmp_path, caplog, monkeypatch):
    """mmengine's AmpOptimWrapper is CUDA-only: asked for on CPU, the run says so instead of ignoring it."""

    monkeypatch.setattr(logging.getLogger("cat"), "propagate", True)  # to caplog, whatever ran before

    cfg = compose_config("det", f"data.root={toy_coco}", "amp.enabled=true")
    with caplog.at_level(logging.WARNING, logger="cat"):
        mm = mm_builder("det")(cfg, DistEnv(), str(tmp_path))
    assert mm.optim_wrapper.type == "OptimWrapper" and "dtype" not in mm.optim_wrapper
    assert "CUDA only; this cpu run trains in float32" in caplog.text


@pytest.mark.parametrize(("rate", "passed"), [("null", None), ("0.3", 0.3)])
def test_drop_path_rate_null_means_the_factory_value(rate, passed):
    """As in classification (cat.models.model_kwargs): null passes nothing, the factory decides."""
    from cat.mm.config import backbone_cfg

    backbone, _ = backbone_cfg(compose_config("det", f"model.backbone.drop_path_rate={rate}").model)
    assert backbone["model_kwargs"].get("drop_path_rate") == passed


@pytest.mark.parametrize("name", ["ca_pvt_tiny", "ca_swin_tiny"])
def test_backbone_grad_checkpointing_recomputes_and_matches(name):
    """The det/seg backbone with grad_checkpointing: its circulant attention runs again in the
    backward (forward_intermediates honours it), and the gradients are unchanged."""
    from cat.mm.backbone import TimmBackbone
    from cat.ops import CirculantAttention

    torch.manual_seed(0)
    plain = TimmBackbone(name, out_indices=(0, 1), model_kwargs={"drop_path_rate": 0.0}).train()
    checkpointed = TimmBackbone(name, out_indices=(0, 1), model_kwargs={"drop_path_rate": 0.0}, grad_checkpointing=True)
    checkpointed.load_state_dict(plain.state_dict())
    calls = []
    attention = next(m for m in checkpointed.modules() if isinstance(m, CirculantAttention))
    attention.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 3, 64, 64)
    for model in (plain, checkpointed.train()):
        sum(f.square().mean() for f in model(x)).backward()
    assert len(calls) == 2
    grads = dict(plain.named_parameters())
    for n, p in checkpointed.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize(
    ("base", "refusal"),
    [
        ("mmdet::{up}{tmp}/payload.py", "leads outside mmdet's config tree"),
        ("mmdet::{tmp}/payload.py", "leads outside mmdet's config tree"),
        ("mmseg::../../../mmdet/.mim/configs/_base_/default_runtime.py", "leads outside mmseg's config tree"),
        ("this::anything", "this:: is not a package cat takes configs from (mmdet, mmseg;"),
        ("os::path.py", "os:: is not a package cat takes configs from"),
        ("{tmp}/missing.py", "no such config file"),
        ("mmdet::mask_rcnn/no-such-config.py", "mmdet ships no config mask_rcnn/no-such-config.py"),
        ("mmdet::" + "a" * 300 + "/x.py", "(312 characters): cannot be looked up (File name too long)"),
    ],
)
def test_a_base_config_names_a_file_and_runs_nothing_else(base, refusal, tmp_path):
    """``model.base``: a packaged base resolves inside its package's config tree, or the check refuses it in one
    line; nothing named is imported or executed on the way (an mmengine config is Python)."""

    marker = tmp_path / "ran"
    (tmp_path / "payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    spec = base.format(up="../" * 30, tmp=str(tmp_path).lstrip("/") if "{up}" in base else tmp_path)
    with pytest.raises(ConfigError) as refused:
        checked_config("det", f"model.base={spec}", f"data.root={tmp_path}", f"output_dir={tmp_path / 'run'}")
    assert any(refusal in problem for problem in refused.value.problems), refused.value.problems
    assert not marker.exists()


def test_a_users_own_base_config_is_a_plain_path(tmp_path):
    from cat.mm.bases import base_config_path

    own = tmp_path / "my_mask_rcnn.py"
    own.write_text("_base_ = []\n")
    assert base_config_path(str(own)) == own
    assert base_config_path("mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py").is_file()
