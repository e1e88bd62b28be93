"""train_cls.py end to end on CPU: presets, eval of the released fixture, DDP parity, kill/resume."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

import cat
from cat.classification.job import run
from cat.data import synthetic_dataset
from cat.errors import ConfigError, DataError
from cat.models import CheckpointMismatchError
from cat.runtime.meter import IntervalStats
from cat.runtime.metric_sinks import read_history
from tests import prewarmed
from tests.conftest import (
    REPO,
    TINY_CLS,
    TOY_RUN_S,
    compose_config,
    descendant_pids,
    quick_few,
    refusal_line,
    run_folder,
    typed_cls,
    typed_config,
)

EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "cls" / "experiment").glob("*.yaml"))
TINY = [
    *TINY_CLS,
    "log_interval=1",
]


def train_cmd(output_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, str(REPO / "train_cls.py"), *TINY, f"output_dir={output_dir}", *overrides]


def env_single_thread() -> dict[str, str]:
    # One thread per process: deterministic reductions, and two ranks fit on two cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train_proc(output_dir: Path, *overrides: str, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """``train_cls.py`` with ``overrides`` into ``output_dir``, run to its end (any exit status)."""
    return prewarmed.run(
        train_cmd(output_dir, *overrides, nproc=nproc),
        cwd=REPO,
        env=env_single_thread(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_train(output_dir: Path, *overrides: str, nproc: int = 1) -> dict:
    proc = train_proc(output_dir, *overrides, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((output_dir / "metrics.json").read_text())


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(output_dir / "last.pth", map_location="cpu", weights_only=True)["model"]


@pytest.mark.parametrize(
    "experiment", quick_few(EXPERIMENTS, {"quickstart", "ca_deit_t", "ca_pvt_t", "ca_swin_t", "cat_t", "table5_ca_pre"})
)
def test_every_experiment_composes_and_builds(experiment):
    cfg = typed_config("cls", f"experiment={experiment}")
    assert cfg.name == experiment or experiment == "quickstart"
    with torch.device("meta"):
        from cat.classification.model_building import build_model

        model = build_model(cfg.model, cfg.data.num_classes, cfg.data.img_size)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_paper_recipe_values():
    cfg = compose_config("cls", "experiment=ca_deit_s")
    assert (cfg.epochs, cfg.lr, cfg.optim.lr_base_batch, cfg.optim.weight_decay, cfg.optim.clip_grad) == (
        300,
        1e-3,
        1024,
        0.05,
        5.0,
    )
    assert (cfg.schedule.sched, cfg.schedule.warmup_epochs) == ("cosine", 20)
    assert (cfg.aug.auto_augment, cfg.aug.mixup, cfg.aug.cutmix, cfg.aug.smoothing, cfg.aug.reprob) == (
        "rand-m9-mstd0.5-inc1",
        0.8,
        1.0,
        0.1,
        0.25,
    )
    assert (cfg.data.name, cfg.data.img_size, cfg.data.crop_pct, cfg.data.interpolation) == (
        "imagenet",
        224,
        0.875,
        "bicubic",
    )
    # Drop path comes from the model factories (the YAML only overrides): the deepest block's rate.
    from cat.classification.model_building import build_model

    drop_path = {}
    for experiment in ("ca_deit_t", "ca_deit_s", "ca_deit_b", "deit_s"):
        cfg = typed_config("cls", f"experiment={experiment}")
        with torch.device("meta"):
            last_block = build_model(cfg.model, 1000, cfg.data.img_size).blocks[-1]
        drop_path[experiment] = getattr(last_block.drop_path1, "drop_prob", 0.0)
    assert drop_path == pytest.approx({"ca_deit_t": 0.0, "ca_deit_s": 0.1, "ca_deit_b": 0.4, "deit_s": 0.1})


def test_eval_mode_on_official_checkpoint(official_ca_deit, tmp_path):
    ckpt = official_ca_deit / "small_p8_64.pth"
    cfg = compose_config(
        "cls",
        "mode=eval",
        f"checkpoint={ckpt}",
        "data=synthetic",
        "data.num_classes=10",
        "data.img_size=64",
        "model.kwargs={embed_dim:64,depth:2,patch_size:8}",
        f"output_dir={tmp_path}",
        "workers=0",
        "logger.wandb.mode=disabled",
    )
    metrics = run(cfg)
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["eval/top1"] == metrics["eval/top1"]
    assert "this eval:" not in (tmp_path / "eval" / "log.txt").read_text()  # 10 classes: not the paper's model
    # The same numbers computed directly from the released weights.
    model = cat.create_model(
        "ca_deit_tiny", checkpoint=ckpt, embed_dim=64, depth=2, patch_size=8, img_size=64, num_classes=10
    ).eval()
    images, labels = synthetic_dataset("val", num_classes=10, img_size=64, samples_per_class=16).tensors
    with torch.no_grad():
        logits = model(images)
    assert metrics["eval/num_images"] == len(labels)
    assert metrics["eval/loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert metrics["eval/top1"] == pytest.approx(100 * (logits.argmax(1) == labels).float().mean().item())


def test_the_papers_top1_stands_only_beside_the_model_the_paper_measured():
    """The eval's line with Table 2's number, for the table's own models at its sizes and 1000 classes; none for an
    ablation, a narrower model of the same name, a converted one, another class count or size. (An eval of
    CA-DeiT-T at 224² on 1000 classes logs it: 1000 images through the model, 45 CPU-seconds, for the one line
    of glue in cat.classification.job._eval.)"""
    from cat.classification.job import beside_the_paper

    table2 = ["experiment=ca_deit_t", "data.img_size=224"]
    assert beside_the_paper(typed_cls(*table2), 1000, 12.345) == (
        "the paper's ImageNet-1K top-1 for CA-DeiT-T at 224²: 75.0% (Table 2); this eval: 12.35%"
    )
    assert beside_the_paper(typed_cls(*table2), 10, 12.0) is None
    assert beside_the_paper(typed_cls(*table2, "data.img_size=384"), 1000, 12.0) is None
    assert beside_the_paper(typed_cls("experiment=table5_ca_d1", "data.img_size=224"), 1000, 12.0) is None
    assert beside_the_paper(typed_cls(*table2, "++model.kwargs.depth=1"), 1000, 12.0) is None
    assert beside_the_paper(typed_cls(*table2, "model.convert={}"), 1000, 12.0) is None


@pytest.fixture(scope="module")
def single_process_batch_16(tmp_path_factory) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("single")
    return run_train(out, "epochs=2", "batch_size=16"), final_weights(out)


@pytest.mark.slow
@pytest.mark.parametrize("split", [["batch_size=8"], ["batch_size=4", "accum_steps=2"]], ids=["ddp", "ddp_accumulated"])
def test_two_process_gloo_matches_single_process(tmp_path, split, single_process_batch_16):
    """The same global batch of 16: one process, or two processes of 8 images per step (each of one
    batch of 8, or of two accumulated batches of 4): the same lr, schedule and training."""
    single, a = single_process_batch_16
    ddp = run_train(tmp_path / "ddp", "epochs=2", *split, nproc=2)
    assert ddp["val/top1"] == pytest.approx(single["val/top1"], abs=1e-6)
    assert ddp["train/loss"] == pytest.approx(single["train/loss"], rel=1e-4)
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-4)
    b = final_weights(tmp_path / "ddp")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5, msg=k)


def _start_and_signal(output_dir: Path, sig: int, *overrides: str, whole_step: bool = False) -> subprocess.Popen:
    """Start a run and send ``sig`` once its second epoch has been checkpointed: to the trainer, or
    (``whole_step``) to it and every process below it, as Slurm signals a job step."""
    proc = prewarmed.Popen(
        train_cmd(output_dir, *overrides),
        cwd=REPO,
        env=env_single_thread(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (output_dir / "epoch_0001.pth").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for pid in descendant_pids(proc.pid) if whole_step else ():
        os.kill(pid, sig)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc


RESUME_RUN = [
    "epochs=12",
    "batch_size=8",
    "save.keep_last=100",
    "data.samples_per_class=64",
    "model.drop_path_rate=0.1",
]


ACCUMULATED = ["batch_size=4", "accum_steps=2"]  # RESUME_RUN's global batch in two micro-batches


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("uninterrupted")
    return run_train(out, *RESUME_RUN), final_weights(out)


@pytest.fixture(scope="module")
def uninterrupted_accumulated(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("uninterrupted_accumulated")
    return run_train(out, *RESUME_RUN, *ACCUMULATED), final_weights(out)


@pytest.mark.slow
def test_sigkill_and_resume_ends_with_identical_weights(tmp_path, uninterrupted):
    out = tmp_path / "killed"
    proc = _start_and_signal(out, signal.SIGKILL, *RESUME_RUN)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "metrics.json").exists()  # it really was cut short
    resumed = run_train(out, *RESUME_RUN)
    expected_metrics, expected_weights = uninterrupted
    assert resumed["val/top1"] == expected_metrics["val/top1"]
    got = final_weights(out)
    for k, v in expected_weights.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_torchrun_restarting_a_killed_worker_goes_on_with_a_run_started_over(tmp_path, uninterrupted):
    """resume=false under torchrun --max-restarts: the worker killed after its second epoch is restarted by torchrun
    with the same command, and goes on from the run its first start began (it started the folder over again)."""
    out = run_folder(tmp_path / "run")
    (out / "metrics.jsonl").write_text("{}\n")  # an earlier run's record
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "--max-restarts=1",
        *train_cmd(out, *RESUME_RUN, "resume=false")[1:],
    ]
    proc = subprocess.Popen(
        command, cwd=REPO, env=env_single_thread(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 300
    while not (out / "epoch_0001.pth").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    (worker,) = [pid for pid in descendant_pids(proc.pid) if "train_cls.py" in Path(f"/proc/{pid}/cmdline").read_text()]
    os.kill(worker, signal.SIGKILL)
    output = proc.communicate(timeout=TOY_RUN_S)[0].decode()
    assert proc.returncode == 0, output[-3000:]
    log = (out / "log.txt").read_text()
    assert re.search(r"started over by torchrun run \S+, now in its worker restart 1; it goes on with that run", log)
    assert re.search(r"resumed from .*last\.pth: epoch \d+", log), log[-3000:]
    assert len(list((out / "earlier_runs").iterdir())) == 1  # the earlier run, set aside once
    _, expected_weights = uninterrupted
    got = final_weights(out)
    for k, v in expected_weights.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_sigterm_to_the_whole_step_saves_and_resumes_identically(tmp_path, uninterrupted):
    """Slurm's stop signal reaches every process of the step: the DataLoader workers go on serving
    the step the trainer finishes; W&B's service process ends, and W&B's part of the run with it, with
    a warning. The trainer saves, exits cleanly and releases the folder, and the resumed run (W&B
    resumed with it) ends with the uninterrupted run's weights."""
    out = tmp_path / "preempted"
    wandb = "logger.wandb.mode=offline"
    proc = _start_and_signal(out, signal.SIGTERM, *RESUME_RUN, wandb, "workers=2", whole_step=True)
    log = proc.stdout.read()
    assert proc.returncode == 0, log
    assert "stop requested" in log and log.count("W&B stopped") == 1, log
    assert "Traceback" not in log and "Exception ignored" not in log, log
    assert not (out / ".lock").exists()
    run_train(out, *RESUME_RUN, wandb, "workers=2")
    assert len({run.name.rpartition("-")[2] for run in (out / "wandb").glob("offline-run-*")}) == 1  # one run id
    _, expected_weights = uninterrupted
    got = final_weights(out)
    for k, v in expected_weights.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_ctrl_c_saves_mid_epoch_and_resumes_identically(tmp_path, uninterrupted):
    """Ctrl-C in a terminal: SIGINT to the foreground job, the trainer and its DataLoader workers. The run
    finishes its step, saves and exits with status 130 (an interrupted command's), without a traceback; the
    resumed run ends with the uninterrupted run's weights. (It lost the epoch's steps before.)"""
    out = tmp_path / "interrupted"
    proc = _start_and_signal(out, signal.SIGINT, *RESUME_RUN, "workers=2", whole_step=True)
    log = proc.stdout.read()
    assert proc.returncode == 128 + signal.SIGINT, log
    assert "Ctrl-C: the run finishes its step, saves and stops" in log and "stop requested" in log, log
    assert "Traceback" not in log and not (out / ".lock").exists(), log
    assert torch.load(out / "last.pth", map_location="cpu", weights_only=True)["step_in_epoch"] > 0
    run_train(out, *RESUME_RUN, "workers=2")
    _, expected_weights = uninterrupted
    got = final_weights(out)
    for k, v in expected_weights.items():
        assert torch.equal(got[k], v), k


# Every speed flag of the trainer at once, with EMA.
SPEED_FLAGS = ["compile=true", "channels_last=true", "amp.enabled=true", "amp.dtype=bf16", "ema.enabled=true"]


@pytest.mark.slow
def test_compiled_bf16_run_with_ema_resumes_identically(tmp_path, uninterrupted):
    """torch.compile, channels-last and bf16 autocast together, with EMA: the checkpoint holds the plain
    model's names (not the compiled wrapper's), and a run stopped mid-epoch resumes to the uninterrupted run's
    weights and EMA weights, bit for bit. The log says it compiled (the one subprocess run through Inductor: that
    compiled steps train as eager is test_compile's, in process)."""
    whole = run_train(tmp_path / "whole", *RESUME_RUN, *SPEED_FLAGS)
    assert (
        "compiled (torch.compile, mode default, one graph): compile=true"
        in (tmp_path / "whole" / "log.txt").read_text()
    )
    out = tmp_path / "preempted"
    proc = _start_and_signal(out, signal.SIGTERM, *RESUME_RUN, *SPEED_FLAGS)
    log = proc.stdout.read()
    assert proc.returncode == 0 and "stop requested" in log, log
    assert run_train(out, *RESUME_RUN, *SPEED_FLAGS)["val/top1"] == whole["val/top1"]
    expected = torch.load(tmp_path / "whole" / "last.pth", map_location="cpu", weights_only=True)
    got = torch.load(out / "last.pth", map_location="cpu", weights_only=True)
    assert expected["model"].keys() == uninterrupted[1].keys()
    for part in ("model", "model_ema"):
        assert got[part].keys() == expected[part].keys(), part
        for k, v in expected[part].items():
            assert torch.equal(got[part][k], v), (part, k)


@pytest.mark.slow
def test_sigterm_with_accumulation_resumes_identically(tmp_path, uninterrupted_accumulated):
    """A stop asked for between two micro-batches finishes their step (a unit test in test_loops
    pins that down), so the resumed run is the uninterrupted one, bit for bit."""
    out = tmp_path / "preempted"
    proc = _start_and_signal(out, signal.SIGTERM, *RESUME_RUN, *ACCUMULATED)
    output = proc.stdout.read()
    assert proc.returncode == 0 and "stop requested" in output, output[-3000:]
    state = torch.load(out / "last.pth", map_location="cpu", weights_only=True)
    assert state["step_in_epoch"] > 0 and state["rng"] is not None
    run_train(out, *RESUME_RUN, *ACCUMULATED)
    _, expected_weights = uninterrupted_accumulated
    got = final_weights(out)
    for k, v in expected_weights.items():
        assert torch.equal(got[k], v), k


@pytest.fixture(scope="module")
def image_data(tmp_path_factory) -> tuple[Path, Path]:
    """A JPEG folder (4 classes told apart by their colour under noise, 24 train and 8 val images
    each), its zip and its tar shards (tools/pack_dataset.py)."""
    root = tmp_path_factory.mktemp("image_data")
    rng = np.random.default_rng(0)
    colours = {"a": (200, 40, 40), "b": (40, 200, 40), "c": (40, 40, 200), "d": (200, 200, 40)}
    for split, count in (("train", 24), ("val", 8)):
        for name, colour in colours.items():
            (root / "folder" / split / name).mkdir(parents=True)
            for i in range(count):
                noise = rng.integers(-50, 50, (40, 48, 3))
                pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / "folder" / split / name / f"{i}.jpg", quality=90)
    pack = [sys.executable, str(REPO / "tools" / "pack_dataset.py"), str(root / "folder")]
    prewarmed.run([*pack, str(root / "zip")], check=True)
    prewarmed.run([*pack, str(root / "tar"), "--format", "tar", "--shard-mb", "0.03"], check=True)
    return root / "folder", root / "zip"


IMAGE_RUN = ["data=folder", "data.num_classes=null", "batch_size=8", "epochs=12", "save.keep_last=100"]


def _format(fmt: str, image_data: tuple[Path, Path]) -> list[str]:
    folder, zipped = image_data
    if fmt == "folder":
        return [f"data.root={folder}"]
    if fmt == "tar":
        return [f"data.root={zipped.parent / 'tar'}", "data.format=tar", "data.shuffle_buffer=16"]
    return [f"data.root={zipped}", "data.format=zip", f"data.cache_mode={fmt.split('-')[1]}"]


@pytest.fixture(scope="module")
def folder_run(image_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted_folder")
    run_train(out, *IMAGE_RUN, *_format("folder", image_data))
    return out


@pytest.fixture(scope="module")
def uninterrupted_folder(folder_run) -> dict[str, torch.Tensor]:
    return final_weights(folder_run)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zip-no", "zip-part"])
def test_zip_trains_as_the_folder_and_resumes_exactly(fmt, image_data, uninterrupted_folder, tmp_path):
    """The zip holds the folder's images and labels in its order, so (one process: part holds all)
    a run from it is the folder's run, bit for bit, also when preempted mid-epoch and resumed."""
    out = tmp_path / fmt
    proc = _start_and_signal(out, signal.SIGTERM, *IMAGE_RUN, *_format(fmt, image_data))
    output = proc.stdout.read()
    assert proc.returncode == 0 and "stop requested" in output, output[-3000:]
    assert torch.load(out / "last.pth", map_location="cpu", weights_only=True)["step_in_epoch"] > 0
    run_train(out, *IMAGE_RUN, *_format(fmt, image_data))
    got = final_weights(out)
    for k, v in uninterrupted_folder.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_tar_stream_trains_as_the_folder_and_resumes_exactly(image_data, folder_run, tmp_path):
    """A tar stream has its own order (shards, then a shuffle buffer), so not the folder's weights but
    its accuracy on the same images; preempted mid-epoch and resumed, it ends with the uninterrupted
    stream's weights, bit for bit."""
    uninterrupted = run_train(tmp_path / "whole", *IMAGE_RUN, *_format("tar", image_data))
    folder = json.loads((folder_run / "metrics.json").read_text())
    assert uninterrupted["epoch"] == folder["epoch"] == 12
    assert folder["val/top1"] >= 90 and uninterrupted["val/top1"] == folder["val/top1"], (uninterrupted, folder)
    out = tmp_path / "preempted"
    proc = _start_and_signal(out, signal.SIGTERM, *IMAGE_RUN, *_format("tar", image_data))
    output = proc.stdout.read()
    assert proc.returncode == 0 and "stop requested" in output, output[-3000:]
    assert torch.load(out / "last.pth", map_location="cpu", weights_only=True)["step_in_epoch"] > 0
    run_train(out, *IMAGE_RUN, *_format("tar", image_data))
    expected, got = final_weights(tmp_path / "whole"), final_weights(out)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_foreign_shards_train_through_the_trainer_with_their_scan_in_the_run_folder(image_data, folder_run, tmp_path):
    """Shards webdataset's ShardWriter wrote (no manifest), in a random order: the trainer reads them through the
    header scan, cached in its run folder (the data folder is left as it was), to the folder's accuracy."""
    import random

    from torchvision.datasets import ImageFolder
    from webdataset import ShardWriter

    data = tmp_path / "foreign"
    data.mkdir()
    for split in ("train", "val"):
        samples = ImageFolder(str(image_data[0] / split)).samples
        random.Random(0).shuffle(samples)
        with ShardWriter(str(data / f"{split}-%06d.tar"), maxcount=40, encoder=False, verbose=0) as sink:
            for index, (path, label) in enumerate(samples):
                sink.write({"__key__": f"{index:06d}", "jpg": Path(path).read_bytes(), "cls": str(label).encode()})
    written = sorted(p.name for p in data.iterdir())
    overrides = [f"data.root={data}", "data.format=tar", "data.shuffle_buffer=16"]
    metrics = run_train(tmp_path / "run", *IMAGE_RUN, *overrides)
    folder = json.loads((folder_run / "metrics.json").read_text())
    assert metrics["val/top1"] >= 90 and folder["val/top1"] >= 90, (metrics, folder)
    assert len(list((tmp_path / "run").glob(".shard-index-*.json"))) == 1
    assert sorted(p.name for p in data.iterdir()) == written


# train_cls.py whose image reads, after AFTER of them in a process, block on a FIFO no one writes to (a hung
# file system's read); it marks the FIFO's path + ".waiting" when one does.
STUCK_READ = """
import runpy, sys
import cat.data.images
fifo, after = sys.argv[1], int(sys.argv[2])
read, calls = cat.data.images.load_rgb, [0]
def stuck(path, **kwargs):
    calls[0] += 1
    if calls[0] > after:
        open(fifo + ".waiting", "w").close()
        with open(fifo, "rb") as f:
            f.read()
    return read(path, **kwargs)
cat.data.images.load_rgb = stuck
sys.argv = ["train_cls.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stop_during_a_stuck_read_ends_the_run_and_saves_its_steps(
    image_data, uninterrupted_folder, tmp_path, workers
):
    """SIGTERM while the data is stuck: the run leaves the wait (after its grace), saves the steps it finished, says
    why and ends (it waited for a step that never came, ignoring SIGTERM, until kill -9); the rerun resumes to the
    end, in one process with the uninterrupted run's weights (the abandoned batch's random draws are undone)."""
    os.mkfifo(tmp_path / "stuck")
    out = tmp_path / "run"
    overrides = [*TINY, f"output_dir={out}", *IMAGE_RUN, *_format("folder", image_data), f"workers={workers}"]
    proc = prewarmed.Popen(
        [sys.executable, "-c", STUCK_READ, str(tmp_path / "stuck"), "30", *overrides],
        cwd=REPO,
        env=env_single_thread(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "stuck.waiting").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    time.sleep(1)  # the main process is now waiting on its stuck batch
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = proc.stdout.read()
    assert "stop requested: SIGTERM while waiting" in log and "the wait is abandoned, the finished steps saved" in log
    saved = torch.load(out / "last.pth", map_location="cpu", weights_only=True)
    assert run_train(out, *IMAGE_RUN, *_format("folder", image_data))["epoch"] == 12
    if workers == 0:  # 30 images read in the first epoch: 3 whole batches of 8, the 4th abandoned
        assert saved["step_in_epoch"] == 3
        got = final_weights(out)
        for k, v in uninterrupted_folder.items():
            assert torch.equal(got[k], v), k


def _fifo_shard(root: Path) -> str:
    (root / "train-000001.tar").unlink()
    os.mkfifo(root / "train-000001.tar")
    return r"train-000001\.tar is a FIFO, not a regular file"


def _count_beyond_the_bytes(root: Path) -> str:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["train-000000.tar"].update(images=10**12, class_counts=[10**12, 0, 0, 0])
    (root / "manifest.json").write_text(json.dumps(manifest))
    return r"train-000000\.tar: its manifest says 1000000000000 images, but its \d+ bytes hold at most \d+"


def _val_label_beyond_train(root: Path) -> str:
    lines = (root / "val_map.txt").read_text().splitlines()
    (root / "val_map.txt").write_text("\n".join([lines[0].rsplit("\t", 1)[0] + "\t9", *lines[1:]]) + "\n")
    (root / "manifest.json").unlink()
    return r"val_map\.txt, line 1: label 9: not one of the 4 classes"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "spoil"), [("tar", _fifo_shard), ("tar", _count_beyond_the_bytes), ("zip-no", _val_label_beyond_train)]
)
def test_a_hostile_packed_split_is_one_line_before_training(image_data, tmp_path, fmt, spoil):
    """Through train_cls.py: exit 2, one line naming the file, nothing trained (a val label beyond train's classes
    was an IndexError after a whole epoch; a FIFO shard blocked the run)."""
    overrides = _format(fmt, image_data)
    source = Path(next(o for o in overrides if o.startswith("data.root=")).split("=", 1)[1])
    root = Path(shutil.copytree(source, tmp_path / "data"))
    message = spoil(root)
    overrides = [o if not o.startswith("data.root=") else f"data.root={root}" for o in overrides]
    proc = train_proc(tmp_path / "run", *IMAGE_RUN, *overrides, timeout=120)
    assert re.search(message, refusal_line(proc)), refusal_line(proc)
    assert "epoch 1/" not in proc.stdout


@pytest.mark.slow
def test_zip_full_cache_trains_as_the_folder(image_data, uninterrupted_folder, tmp_path):
    run_train(tmp_path, *IMAGE_RUN, *_format("zip-full", image_data))
    got = final_weights(tmp_path)
    for k, v in uninterrupted_folder.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_wandb_offline_files_and_outputs(tmp_path):
    # With interval rows every 2 steps and a profiler window over steps 2-3.
    metrics = run_train(
        tmp_path,
        "epochs=1",
        "batch_size=16",
        "logger.wandb.mode=offline",
        "ema.enabled=true",
        "log_interval=2",
        "profile.steps=[2,3]",
    )
    assert set(metrics) >= {"val/top1", "val/top5", "val/loss", "val/best_top1", "val/ema_top1", "train/loss", "epoch"}
    # One name per metric (cat.classification.metrics): metrics.json's are metrics.jsonl's (and W&B's).
    last_epoch = [row for row in read_history(tmp_path / "metrics.jsonl") if "val/top1" in row][-1]
    assert {k: v for k, v in metrics.items() if "/" in k} == {k: last_epoch[k] for k in metrics if "/" in k}
    intervals = [row for row in read_history(tmp_path / "metrics.jsonl") if "train/step_s" in row]
    assert intervals and all(
        set(row) >= {f"train/{f.name}" for f in dataclasses.fields(IntervalStats)} for row in intervals
    )
    cpu = (row["train/mfu"] is None and row["train/tflops"] > 0 and row["train/img_s"] > 0 for row in intervals)
    assert all(cpu)  # a CPU: no listed peak
    assert (tmp_path / "profile" / "steps_2-3" / "rank0.pt.trace.json").is_file()
    assert "profile of steps 2-3 (rank 0)" in (tmp_path / "log.txt").read_text()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    log = (tmp_path / "log.txt").read_text()
    assert (tmp_path / "config.yaml").is_file() and log.count("epoch 1/1  train loss") == 1
    # The start says how the run computes, and why: the defaults (auto) on a CPU are float32 and eager.
    assert "precision: float32 (amp.enabled=auto on cpu)\n" in log
    assert "eager: compile=auto on cpu (compiles on CUDA only)\n" in log
    assert log.index("precision: ") < log.index("epoch 1/1  train loss")
    assert f"ema top1 {metrics['val/ema_top1']:.2f}" in log
    # An evaluation reports both results of the run: the model's and its weight EMA's.
    run_train(tmp_path, "mode=eval")  # the checkpoint holds a weight EMA: no key asks for it
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())  # the evaluation's own record
    assert (evaluated["eval/top1"], evaluated["eval/ema_top1"]) == (metrics["val/top1"], metrics["val/ema_top1"])
    eval_log = (tmp_path / "eval" / "log.txt").read_text()
    assert "its weight EMA: top1" in eval_log and "precision: float32 (amp.enabled=auto on cpu)\n" in eval_log
    # A fine-tune from the weight EMA (checkpoint_ema=true) says what it starts from; a profiler window past its
    # end says at the start that it will record nothing.
    fine_tune = ["epochs=1", f"checkpoint={tmp_path / 'best.pth'}", "checkpoint_ema=true", "profile.steps=[1000,2000]"]
    run_train(tmp_path / "from_ema", *fine_tune)
    log = (tmp_path / "from_ema" / "log.txt").read_text()
    assert f"weights from {tmp_path / 'best.pth'}, its weight EMA\n" in log
    assert "profile.steps=[1000, 2000]: this run has " in log and not (tmp_path / "from_ema" / "profile").exists()
    ckpt = torch.load(tmp_path / "best.pth", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "scaler", "model_ema", "epoch", "best_top1", "config", "rng"} <= set(
        ckpt
    )
    assert OmegaConf.create(ckpt["config"]).data.name == "synthetic"
    # The checkpoint is in the release format, so cat.create_model loads it.
    cat.create_model(
        "ca_deit_tiny",
        checkpoint=tmp_path / "best.pth",
        embed_dim=16,
        depth=1,
        patch_size=8,
        img_size=32,
        num_classes=4,
    )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (
            ["data=folder", "data.root=/nonexistent/imagenet"],
            ConfigError,
            "data.root=/nonexistent/imagenet: not a folder",
        ),
        (["model.name=ca_deit_tinyy"], ConfigError, "unknown model 'ca_deit_tinyy'"),
        (["aug=deit", "batch_size=7"], ConfigError, "must be even"),
        (["batch_size=1000"], ConfigError, "fewer than one global batch"),
        (["mode=fit"], ConfigError, "mode='fit': expected one of train, eval, throughput"),
    ],
)
def test_clear_errors(tmp_path, overrides, error, match):
    cfg = compose_config("cls", *TINY, f"output_dir={tmp_path}", *overrides)
    with pytest.raises(error, match=match):
        run(cfg)


def test_throughput_needs_no_dataset_and_builds_the_model_for_its_size(tmp_path):
    """The README's throughput line: an ImageNet experiment with no data.root measures the model on
    random images, at throughput.img_size, for which a fixed-size timm ViT is built (its checkpoint's
    position embeddings resampled). Train and eval with the same config still name the missing data.root."""
    deit = ["experiment=deit_t", "++model.kwargs.depth=1", "logger.wandb.mode=disabled"]
    run(
        compose_config(
            "cls", *deit, *TINY_CLS[:2], "aug=none", "epochs=1", "batch_size=8", f"output_dir={tmp_path / 'trained'}"
        )
    )
    throughput = ["mode=throughput", "data.num_classes=4", "throughput.batch_size=2", "throughput.iters=1"]
    for size, checkpoint in ((None, None), (96, tmp_path / "trained" / "best.pth")):
        metrics = run(
            compose_config(
                "cls", *deit, *throughput, f"throughput.img_size={size or 'null'}",
                f"checkpoint={checkpoint or 'null'}", f"output_dir={tmp_path / str(size)}",
            )
        )  # fmt: skip
        assert metrics["img_size"] == [size or 224] * 2 and metrics["throughput_img_s"] > 0
    for mode in ("train", "eval"):
        with pytest.raises(ConfigError, match=r"data.root=None: not a folder \(data=imagenet"):
            run(compose_config("cls", *deit, f"mode={mode}", f"output_dir={tmp_path / mode}"))


def test_empty_class_folder_is_named(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / "data" / split / "cat").mkdir(parents=True)
        (tmp_path / "data" / split / "dog").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "data" / split / "cat" / "a.png")
    cfg = compose_config(
        "cls", *TINY, "data=folder", f"data.root={tmp_path / 'data'}", f"output_dir={tmp_path / 'out'}"
    )
    with pytest.raises(DataError, match=r"train/dog holds no images"):
        run(cfg)


def test_model_convert_fine_tunes_a_softmax_checkpoint(tmp_path):
    """model.convert: a softmax DeiT's checkpoint loads, the model converts, trains, and its converted
    checkpoint evaluates with the same setting."""
    deit = ["model.name=deit_tiny_patch16_224", "model.kwargs={embed_dim:24,depth:1,patch_size:8}", "epochs=1"]
    run(compose_config("cls", *TINY, *deit, f"output_dir={tmp_path / 'softmax'}"))
    softmax = cat.models.extract_state_dict(cat.models.load_checkpoint_file(tmp_path / "softmax" / "best.pth"))
    converted = [
        *TINY,
        *deit,
        "model.convert={}",
        f"checkpoint={tmp_path / 'softmax' / 'best.pth'}",
        "lr=1e-12",  # the loaded weights stay (to rounding) as they were: the conversion must keep them
        "schedule.warmup_epochs=0",
    ]
    trained = run(compose_config("cls", *converted, f"output_dir={tmp_path / 'converted'}"))
    state = cat.models.extract_state_dict(cat.models.load_checkpoint_file(tmp_path / "converted" / "best.pth"))
    assert "blocks.0.attn.gate.0.weight" in state
    torch.testing.assert_close(state["blocks.0.attn.qkv.weight"], softmax["blocks.0.attn.qkv.weight"])
    evaluated = run(
        compose_config(
            "cls", *converted[:-3], "mode=eval", f"checkpoint={tmp_path / 'converted' / 'best.pth'}",
            f"output_dir={tmp_path / 'eval'}",
        )
    )  # fmt: skip
    assert evaluated["eval/top1"] == pytest.approx(trained["val/best_top1"])
    # Evaluated as the softmax model it came from: the error names the setting its run had.
    with pytest.raises(CheckpointMismatchError) as error:
        run(
            compose_config(
                "cls", *TINY, *deit, "mode=eval", f"checkpoint={tmp_path / 'converted' / 'best.pth'}",
                f"output_dir={tmp_path / 'eval_softmax'}",
            )
        )  # fmt: skip
    assert "(its run trained model.convert={} where this model has None: build the model it was trained as" in str(
        error.value
    )


@pytest.mark.slow
def test_zip_part_cache_holds_half_the_images_on_each_of_two_ranks(image_data, tmp_path):
    folder, _ = image_data
    one_epoch = [o for o in IMAGE_RUN if not o.startswith("epochs=")] + ["epochs=1"]
    proc = train_proc(tmp_path, *one_epoch, *_format("zip-part", image_data), nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = re.search(
        r"zip cache \(part\): ([\d.]+), ([\d.]+) MB held by ranks 0-1; the train split's images: ([\d.]+) MB",
        (tmp_path / "log.txt").read_text(),
    )
    assert line, (tmp_path / "log.txt").read_text()
    rank0, rank1, total = map(float, line.groups())
    assert total == pytest.approx(sum(f.stat().st_size for f in (folder / "train").rglob("*.jpg")) / 1e6, abs=0.05)
    assert rank0 + rank1 == pytest.approx(total, abs=0.1)
    assert rank0 == pytest.approx(total / 2, rel=0.1) and rank1 == pytest.approx(total / 2, rel=0.1)


def test_weights_that_do_not_fit_are_refused_before_the_data_is_read(tmp_path):
    """checkpoint= of another model, the class count in the config: refused before the datasets are built (the
    scan of ImageNet's folders takes minutes on a network file system), here before a folder the build refuses."""
    root = tmp_path / "data"
    for split, classes in (("train", "ab"), ("val", "a")):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            Image.new("RGB", (32, 32)).save(root / split / name / "0.png")
    other = tmp_path / "wider.pth"
    wider = cat.create_model("ca_deit_tiny", img_size=32, num_classes=2, embed_dim=32, depth=1, patch_size=8)
    torch.save({"model": wider.state_dict()}, other)
    args = [*(a for a in TINY if not a.startswith("data=")), "data=folder", f"data.root={root}", "data.num_classes=2"]
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch patch_embed.proj.weight: model \(16, 3, 8, 8\)"):
        run(compose_config("cls", *args, f"checkpoint={other}", f"output_dir={tmp_path / 'run'}"))
    with pytest.raises(DataError, match="hold different class folders"):  # the data's own refusal, comes next
        run(compose_config("cls", *args, f"output_dir={tmp_path / 'run2'}"))


def test_evaluation_refuses_weights_that_do_not_fit_before_the_data_is_read(tmp_path):
    """mode=eval with the class count in the config: the checkpoint is read and refused before the val set is
    built, here before a val folder that does not exist."""
    root = tmp_path / "data"
    (root / "train" / "a").mkdir(parents=True)
    args = [*(a for a in TINY if not a.startswith("data=")), "data=folder", f"data.root={root}", "data.num_classes=2"]
    args += ["mode=eval", f"output_dir={tmp_path / 'run'}"]
    small = dict(img_size=32, num_classes=2, depth=1, patch_size=8)
    for name, model in (("wider", dict(embed_dim=32)), ("fits", dict(embed_dim=16))):
        torch.save({"model": cat.create_model("ca_deit_tiny", **small, **model).state_dict()}, tmp_path / name)
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch patch_embed.proj.weight: model \(16, 3, 8, 8\)"):
        run(compose_config("cls", *args, f"checkpoint={tmp_path / 'wider'}"))
    # A checkpoint that fits: the data's own refusal comes next.
    with pytest.raises(DataError, match="split folder not found"):
        run(compose_config("cls", *args, f"checkpoint={tmp_path / 'fits'}"))
