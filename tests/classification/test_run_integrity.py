"""Run integrity of train_cls.py: a run's record is never overwritten or misstated, bad values fail
at once with one line, a diverged run keeps its last good checkpoint, batch logs stay plain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from cat.runtime.io import temporary_path
from cat.runtime.resume import START_OVER
from tests import prewarmed
from tests.classification.test_train_cls import env_single_thread, final_weights, run_train, train_cmd, train_proc
from tests.conftest import REPO
from tests.entry_cases import run_entry_cases
from tests.subprocess_output import output_tail

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out


def test_eval_and_throughput_leave_the_training_record_untouched(tmp_path):
    run_train(tmp_path, "epochs=1", "batch_size=16")
    record = {name: (tmp_path / name).read_bytes() for name in ("metrics.json", "config.yaml", "log.txt", "best.pth")}
    run_train(tmp_path, "mode=eval")  # checkpoint defaults to output_dir/best.pth
    run_train(tmp_path, "mode=throughput", "throughput.iters=2", "throughput.warmup=1")
    for name, content in record.items():
        assert (tmp_path / name).read_bytes() == content, name
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["checkpoint"] == str(tmp_path / "best.pth")
    assert "throughput_img_s" in json.loads((tmp_path / "throughput" / "metrics.json").read_text())
    assert "mode: eval" in (tmp_path / "eval" / "config.yaml").read_text()


def test_sigterm_ends_a_run_with_nothing_to_save_at_once(tmp_path):
    """A stop signal to an evaluation or throughput run ends it (it has no checkpoint to write, and no loop
    that would read the flag a training run reads): status 143, one line saying so, the folder released."""
    run = prewarmed.Popen(
        train_cmd(tmp_path, "mode=throughput", "throughput.iters=100000000", "throughput.warmup=1"),
        cwd=REPO,
        env=env_single_thread(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "throughput" / "log.txt"
    try:
        deadline = time.monotonic() + 120
        while "throughput mode on" not in (log.read_text() if log.exists() else ""):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        run.kill()
        run.wait()
    assert "stopped by SIGTERM: nothing to save in throughput mode; the run ends here" in log.read_text()
    assert "Traceback" not in run.stderr.read()
    assert not (tmp_path / "throughput" / ".lock").exists() and not (tmp_path / "throughput" / "metrics.json").exists()


def test_second_concurrent_run_is_refused_and_a_dead_holder_is_taken_over(tmp_path):
    # Epochs of the tiny config take a fraction of a second: the first run is given more than it can
    # finish before it is killed, and the wait is for last.pth (kept from the first save on) rather
    # than an epoch snapshot, which keep_last rotates away within one epoch.
    first = prewarmed.Popen(
        train_cmd(tmp_path, "epochs=100000", "batch_size=8"),
        cwd=REPO,
        env=env_single_thread(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "last.pth").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        # A user copies files into the folder while the run trains; the run goes on recording what it makes (its
        # next saves) and never takes them for its own.
        (tmp_path / "notes.txt").write_text("mine")
        (tmp_path / "imagenet_pretrained.pth").write_bytes(b"weights")
        saved = (tmp_path / ".cat-made").stat().st_mtime_ns
        while (tmp_path / ".cat-made").stat().st_mtime_ns == saved:  # a record made after the user's files came
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert "notes.txt" not in json.loads((tmp_path / ".cat-made").read_text())["names"]
        second = train_proc(tmp_path, "epochs=100000", "batch_size=8", timeout=300)
        assert second.returncode == 2
        assert (
            second.stderr.strip()
            .splitlines()[-1]
            .startswith(f"error: output_dir {tmp_path} is in use by another run (pid {first.pid}")
        )
    finally:
        first.kill()
        first.wait()
    leftover = Path(temporary_path(str(tmp_path / "last.pth")))
    leftover.write_bytes(b"partial")  # what a writer killed mid-save leaves
    (tmp_path / ".notes.tmp").write_text("the user's")  # a name cat's writers never make: kept
    # A fresh run there (resume=false: the killed run has trained more epochs than this one asks for).
    proc = train_proc(tmp_path, "epochs=1", "batch_size=8", "resume=false", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"its process {first.pid} is gone" in proc.stdout and f"removed {leftover}" in proc.stdout
    assert not leftover.exists() and not (tmp_path / ".lock").exists()
    # Neither deleted nor moved: starting over sets aside what runs make, and a user's file stays where it is.
    assert (tmp_path / ".notes.tmp").read_text() == "the user's"
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "imagenet_pretrained.pth").read_bytes() == b"weights"
    assert "imagenet_pretrained.pth" in proc.stdout and "notes.txt" in proc.stdout
    assert not list((tmp_path / "earlier_runs").glob("*/.notes.tmp"))


def test_extending_epochs_on_resume_follows_the_new_schedule(tmp_path):
    """The documented rule: a resumed run follows the schedule of its current config from the step it
    resumed at, as if that config had been planned from the start; config.yaml says what runs now and
    config_changes.jsonl records when it changed."""
    run_train(tmp_path / "a", "epochs=1", "batch_size=16")
    extended = run_train(tmp_path / "a", "epochs=3", "batch_size=16")
    run_train(tmp_path / "b", "epochs=3", "batch_size=16")
    state = torch.load(tmp_path / "a" / "last.pth", weights_only=True)
    reference = torch.load(tmp_path / "b" / "last.pth", weights_only=True)
    # Epochs 2-3 ran on the 3-epoch cosine: the final lr equals the planned run's, not the 1-epoch floor.
    assert state["optimizer"]["param_groups"][0]["lr"] == reference["optimizer"]["param_groups"][0]["lr"]
    assert extended["epoch"] == 3 and "epochs: 3" in (tmp_path / "a" / "config.yaml").read_text()
    change = json.loads((tmp_path / "a" / "config_changes.jsonl").read_text().splitlines()[-1])
    assert change["epoch"] == 2 and change["changed"]["epochs"] == [1, 3]
    log = (tmp_path / "a" / "log.txt").read_text()
    assert "config changed since the checkpoint, applied from here on: epochs: 1 -> 3" in log
    # Fewer epochs than it trained: refused, and the record still says what trained.
    record = {name: (tmp_path / "a" / name).read_text() for name in ("config.yaml", "metrics.json")}
    proc = train_proc(tmp_path / "a", "epochs=2", "batch_size=16")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: invalid config: epochs=2: {tmp_path / 'a' / 'last.pth'} has trained 3 epochs; a shorter run needs "
        f"another output_dir (or {START_OVER})"
    )
    # A finished run given another lr (a new try in the same output_dir): it would train nothing, so it is refused.
    proc = train_proc(tmp_path / "a", "epochs=3", "batch_size=16", "lr=1e-4")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "has finished its 3 epochs, so lr: 0.002 -> 0.0001 would train nothing: a run with them needs its own "
        "output_dir (or name=), or a longer run to continue this one"
    )
    assert {name: (tmp_path / "a" / name).read_text() for name in record} == record


def test_a_resume_needs_no_starting_checkpoint(tmp_path):
    """``checkpoint=`` is where a run started; once it has a last.pth (a requeued fine-tuning job), the
    starting weights may have moved: the resume neither needs nor reads them, and a new run still does."""
    start = tmp_path / "start.pth"
    run_train(tmp_path / "source", "epochs=1", "batch_size=16")
    start.write_bytes((tmp_path / "source" / "last.pth").read_bytes())
    run_train(tmp_path / "run", "epochs=1", "batch_size=16", f"checkpoint={start}")
    start.unlink()
    assert run_train(tmp_path / "run", "epochs=2", "batch_size=16", f"checkpoint={start}")["epoch"] == 2
    proc = train_proc(tmp_path / "new", "epochs=1", "batch_size=16", f"checkpoint={start}")
    assert proc.returncode == 2 and f"checkpoint={start}: no such file" in proc.stderr


def test_resume_refuses_a_different_model_and_keeps_the_record(tmp_path):
    run_train(tmp_path, "epochs=1", "batch_size=16")
    config = (tmp_path / "config.yaml").read_text()
    proc = train_proc(
        tmp_path, "epochs=2", "batch_size=16", "model.kwargs={embed_dim:32,depth:1,patch_size:8}", timeout=300
    )
    assert proc.returncode == 2
    assert "cannot resume" in proc.stderr and "model.kwargs.embed_dim: 16 -> 32" in proc.stderr
    assert (tmp_path / "config.yaml").read_text() == config


def test_nan_run_keeps_the_previous_good_checkpoint(tmp_path):
    run_train(tmp_path, "epochs=1", "batch_size=8")
    good = final_weights(tmp_path)
    proc = train_proc(tmp_path, "epochs=3", "batch_size=8", "lr=1e6", timeout=300)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "non-finite" in last and "epoch 2" in last and "is kept" in last
    state = torch.load(tmp_path / "last.pth", weights_only=True)
    assert state["epoch"] == 0  # still epoch 1 (0-based 0): nothing of the diverged epoch was saved
    for key, value in good.items():
        assert torch.equal(state["model"][key], value)


BAD_VALUES = [
    ("amp.dtype=fp32", "amp.dtype='fp32': expected one of auto, bf16, fp16"),
    ("logger.wandb.mode=bogus", "logger.wandb.mode='bogus': expected one of"),
    ("data.img_size=30", "does not run at 30x30"),
    ("epochs=0", "epochs=0: expected an integer >= 1"),
    ("epochs=abc", "epochs='abc': expected an integer >= 1"),
    ("batch_size=0", "batch_size=0: expected an integer >= 1"),
    ("lr=-1", "lr=-1: expected a number > 0"),
    ("output_dir=/sys/kernel/run", "output_dir=/sys/kernel/run: cannot write in /sys/kernel"),
]


@pytest.fixture(scope="module")
def bad_value_runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Every BAD_VALUES override on data=folder with a root whose images are unreadable (reading any
    image would fail differently), in one interpreter (``tests.entry_cases``)."""
    root = tmp_path_factory.mktemp("bad_values")
    for split in ("train", "val"):
        (root / "data" / split / "a").mkdir(parents=True)
        (root / "data" / split / "a" / "x.png").write_bytes(b"not a png")
    data = ["data=folder", f"data.root={root / 'data'}", "data.num_classes=null"]
    cases = {override: train_cmd(root / "out", *data, override)[2:] for override, _ in BAD_VALUES}
    return root, run_entry_cases("train_cls.py", cases, env=env_single_thread())


@pytest.mark.parametrize("override, message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_fails_before_any_data_is_read(bad_value_runs, override, message):
    root, runs = bad_value_runs
    proc = runs[override]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr.strip().splitlines()[-1]
    assert not (root / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits (/sys covers this case)")
def test_unwritable_existing_output_dir(tmp_path):
    out = tmp_path / "ro"
    out.mkdir(mode=0o555)
    proc = prewarmed.run(train_cmd(out), cwd=REPO, env=env_single_thread(), capture_output=True, text=True)
    assert proc.returncode == 2 and f"output_dir={out}: cannot write" in proc.stderr


def test_corrupt_image_is_named(tmp_path):
    root = tmp_path / "data"
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 40), (60 * i, 0, 0)).save(root / split / cls / f"{i}.png")
    bad = root / "train" / "b" / "2.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    proc = train_proc(
        tmp_path / "out",
        "data=folder",
        f"data.root={root}",
        "data.num_classes=null",
        "batch_size=4",
        "epochs=1",
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot read image {bad}")


def test_batch_log_is_plain_and_numbered_like_the_epochs(tmp_path):
    proc = train_proc(tmp_path, "epochs=2", "batch_size=8", "log_interval=4", timeout=300)
    assert proc.returncode == 0, output_tail(proc)
    output = proc.stdout + proc.stderr
    assert "\r" not in output
    assert "epoch 1/2 step 4/8  loss" in output and "epoch 2/2 step 8/8  loss" in output
    assert "epoch 1/2  train loss" in output and "epoch 2/2  train loss" in output


def test_tool_user_errors_exit_2(tmp_path):
    proc = prewarmed.run(
        [sys.executable, str(REPO / "tools" / "make_tables.py"), str(tmp_path / "nonexistent")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: not a folder: {tmp_path / 'nonexistent'}"
