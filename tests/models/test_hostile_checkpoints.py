"""The malicious-file suite: every entry point that reads a checkpoint refuses each hostile file,
names the file and the refused global, and nothing runs (the payload's marker file never appears)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cat
from cat.classification.job import run
from cat.errors import CheckpointError
from cat.models import load_checkpoint_file
from tests import prewarmed
from tests.conftest import REPO, TINY_CLS, compose_config, refusal_line, run_folder
from tests.hostile import load_with_pickles_own_build, write_build_on_class, write_build_on_tensor, write_hostile_files

HOSTILE = [
    "plain_pickle",
    "legacy_torch",
    "zip_torch",
    "yacs_config_payload",
    "getattr_chain",
    "nested_reducers",
    "build_on_class",
    "build_on_tensor",
]
# What each file's refusal names (default: the os.system global it reaches for).
REFUSED = {"getattr_chain": "getattr", "build_on_class": "BUILD on the class", "build_on_tensor": "BUILD on a Tensor"}
TINY = [
    *TINY_CLS,
    "epochs=1",
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    folder = tmp_path_factory.mktemp("hostile")
    marker = folder / "MARKER"
    return write_hostile_files(folder / "files", marker), marker


def assert_refused(message: str, path: Path, name: str, marker: Path) -> None:
    assert str(path) in message, message
    assert REFUSED.get(name, "system") in message, message
    assert not marker.exists() and not Path(f"{marker}.patch").exists(), f"{name}: the payload ran"


@pytest.mark.parametrize("name", HOSTILE)
def test_create_model(hostile, name):
    files, marker = hostile
    with pytest.raises(CheckpointError) as err:
        cat.create_model("ca_deit_tiny", checkpoint=files[name], embed_dim=16, depth=1, patch_size=8, img_size=32)
    assert_refused(str(err.value), files[name], name, marker)


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_train_cls_checkpoint(hostile, name, mode, tmp_path):
    files, marker = hostile
    cfg = compose_config("cls", *TINY, f"mode={mode}", f"checkpoint={files[name]}", f"output_dir={tmp_path}")
    with pytest.raises(CheckpointError) as err:
        run(cfg)
    assert_refused(str(err.value), files[name], name, marker)


@pytest.mark.parametrize("name", HOSTILE)
def test_train_cls_resume(hostile, name, tmp_path):
    files, marker = hostile
    (run_folder(tmp_path) / "last.pth").write_bytes(files[name].read_bytes())
    (tmp_path / "epoch_0001.pth").write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        run(compose_config("cls", *TINY, f"output_dir={tmp_path}"))
    message = str(err.value)
    assert_refused(message.replace(str(tmp_path / "last.pth"), str(files[name])), files[name], name, marker)
    assert "resume=false" in message and "epoch_0001.pth" in message


@pytest.mark.parametrize("tool", ["bccb_analysis", "visualize_kernels", "export_onnx"])
@pytest.mark.parametrize("name", ["legacy_torch", "getattr_chain", "yacs_config_payload", "build_on_class"])
def test_tools(hostile, tool, name, tmp_path, run_tool):
    files, marker = hostile
    model = [] if tool == "bccb_analysis" else ["--model", "ca_deit_tiny"]  # bccb: its softmax default
    args = [*model, "--checkpoint", str(files[name]), "--out", str(tmp_path / "out")]
    stderr = run_tool(tool, *args, expect=2, stderr=True)
    assert "Traceback" not in stderr
    assert_refused(stderr, files[name], name, marker)


@pytest.mark.slow
def test_entry_point_exit_status_and_one_line(hostile, tmp_path):
    files, marker = hostile
    proc = prewarmed.run(
        [
            sys.executable,
            str(REPO / "train_cls.py"),
            *TINY,
            "mode=eval",
            f"checkpoint={files['zip_torch']}",
            f"output_dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = refusal_line(proc)
    assert last.startswith("error: refusing to load checkpoint") and "posix.system" in last or "os.system" in last
    assert not marker.exists()


@pytest.mark.slow
def test_build_payloads_fire_without_the_build_check(tmp_path):
    """The two BUILD files do what they claim against a reader with pickle's own BUILD."""
    marker = tmp_path / "MARKER"
    write_build_on_class(tmp_path / "class.pth", str(marker))
    # A child process: the payload rewrites the stand-in class for the rest of the process.
    code = f"from tests.hostile import load_with_pickles_own_build as load; load({str(tmp_path / 'class.pth')!r})"
    prewarmed.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, check=True)
    assert "attacker's text" in Path(f"{marker}.patch").read_text()
    write_build_on_tensor(tmp_path / "tensor.pth")
    tensor = load_with_pickles_own_build(tmp_path / "tensor.pth")["model"]["w"]
    assert dict(tensor._backward_hooks) == {0: set}


@pytest.mark.parametrize("name", ["build_on_class", "build_on_tensor"])
def test_build_refusals_leave_the_reader_intact(hostile, name, official_ca_deit):
    """A refused BUILD changed nothing: the released checkpoint still loads in the same process."""
    files, marker = hostile
    with pytest.raises(CheckpointError):
        load_checkpoint_file(files[name])
    released = load_checkpoint_file(official_ca_deit / "small_p8_64.pth")
    assert released["model"] and not Path(f"{marker}.patch").exists()


def test_a_detection_checkpoint_read_for_a_model_says_whose_it_is(tmp_path):
    """mmengine's message history in a train_det.py/train_seg.py checkpoint is refused outside those trainers, with
    where the file belongs instead of "re-save it if you trust it" (cat wrote it)."""
    history_buffer = pytest.importorskip("mmengine.logging.history_buffer")
    import torch

    torch.save({"state_dict": {}, "message_hub": {"log": history_buffer.HistoryBuffer()}}, tmp_path / "iter_2.pth")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint_file(tmp_path / "iter_2.pth")
    assert str(error.value).endswith(
        "mmengine's classes are in the checkpoints of train_det.py and train_seg.py (a whole detector or segmentor), "
        "which those trainers read"
    )
