"""The Hydra -> mmengine bridge refuses bad input with errors that name the problem."""

from __future__ import annotations

import pytest

from cat.errors import DataError
from cat.runtime.dist import DistEnv
from tests.conftest import compose_config

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")


@pytest.mark.parametrize(("task", "layout"), [("det", "COCO layout"), ("seg", "ADE20K layout")])
@pytest.mark.parametrize("root", [None, "missing"])
def test_missing_data_root(task, layout, root, tmp_path):
    from cat.mm.det import build_det_config
    from cat.mm.seg import build_seg_config

    data_root = "null" if root is None else str(tmp_path / root)
    cfg = compose_config(task, f"data.root={data_root}", f"output_dir={tmp_path}", "logger.wandb.mode=disabled")
    build = build_det_config if task == "det" else build_seg_config
    with pytest.raises(DataError, match=layout) as error:
        build(cfg, DistEnv(), str(tmp_path))
    assert f"data.root={None if root is None else str(tmp_path / root)!r}" in str(error.value)


@pytest.mark.parametrize("task", ["det", "seg"])
def test_strict_load_must_be_a_bool(task, tmp_path):
    """The det/seg key this round added: an invalid value is one line, exit 2, and no folder is made."""
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / f"train_{task}.py"),
            f"data.root={tmp_path}",
            f"output_dir={out}",
            "strict_load=maybe",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "strict_load='maybe': expected true or false" in last, last
    assert not out.exists()
