"""cat.runtime.cells on its own: a cell's folder stays inside its sweep's, a refused cell leaves its one line
there (never over an earlier log), and the sweep's report finds the other cells that failed in this launch."""

from __future__ import annotations

import os
import time

import pytest
from omegaconf import OmegaConf

from cat.errors import ConfigError, SweepCellError
from cat.runtime.cells import cell_dir, other_failed_cells, record_refused_cell


def _sweep(folder, subdir: str):
    return OmegaConf.create({"dir": str(folder), "subdir": subdir})


def test_a_cells_folder_is_its_overrides_inside_the_sweeps(tmp_path):
    assert cell_dir(_sweep(tmp_path, "seed=0,lr=0.1")) == str(tmp_path / "seed=0,lr=0.1")
    assert cell_dir(_sweep(tmp_path, "checkpoint=/w/a.pth")) == str(tmp_path / "checkpoint=") + "/w/a.pth"
    for leaving in ("../x", "a/../../x", "/etc", "seed=0\n"):
        with pytest.raises(ConfigError, match="outside the sweep's folder"):
            cell_dir(_sweep(tmp_path, leaving))


def test_a_refused_cell_leaves_its_line_but_never_over_a_log(tmp_path, monkeypatch):
    monkeypatch.setattr("cat.runtime.cells.write_overrides", lambda folder: None)  # Hydra's overrides: none here
    record_refused_cell(_sweep(tmp_path, "seed=1"), "data.root=/nowhere: not a folder")
    log = (tmp_path / "seed=1" / "log.txt").read_text()
    assert log.startswith("[") and log.rstrip().endswith("] error: data.root=/nowhere: not a folder")
    (tmp_path / "seed=2").mkdir()
    (tmp_path / "seed=2" / "log.txt").write_text("[2026-12-05 07:00:00] a run's own log\n")
    record_refused_cell(_sweep(tmp_path, "seed=2"), "another error")
    assert (tmp_path / "seed=2" / "log.txt").read_text() == "[2026-12-05 07:00:00] a run's own log\n"
    record_refused_cell(_sweep(tmp_path, "../out"), "outside")  # a folder outside the sweep's: nothing written
    assert not (tmp_path.parent / "out").exists()


def test_the_other_failed_cells_of_this_launch(tmp_path):
    since = time.time()
    logs = {
        "seed=0": "[2026-12-05 07:00:00] error: the cell that raised",  # the one Hydra reports: not repeated
        "seed=1": "[2026-12-05 07:00:00] error: data.root=/a: not a folder",
        "seed=2": "[2026-12-05 07:00:00] epoch 3 done",  # ran fine
        "seed=3": "[2026-12-05 07:00:00] error: an error from an earlier launch",
    }
    for cell, line in logs.items():
        (tmp_path / cell).mkdir()
        (tmp_path / cell / "log.txt").write_text(line + "\n")
    os.utime(tmp_path / "seed=3" / "log.txt", (since - 3600, since - 3600))
    (tmp_path / "notes.txt").write_text("not a cell")
    error = SweepCellError("the cell that raised", str(tmp_path), "seed=0")
    assert other_failed_cells(error, since) == ["sweep cell seed=1: data.root=/a: not a folder"]
    assert other_failed_cells(SweepCellError("x", None, None), since) == []
