"""cat.runtime.cells on its own: a cell's folder stays inside its sweep's, a refused cell leaves its one line
there (never over an earlier log), and the sweep's report finds the other cells that failed in this launch."""

from __future__ import annotations

import os
import time

import pytest
from omegaconf import OmegaConf

from cat.errors import ConfigError, SweepCellError
from cat.runtime.cells import cell_dir, command_line_problems, other_failed_cells, record_refused_cell


def _sweep(folder, subdir: str):
    return OmegaConf.create({"dir": str(folder), "subdir": subdir})


def test_a_cells_folder_is_its_overrides_inside_the_sweeps(tmp_path):
    assert cell_dir(_sweep(tmp_path, "seed=0,lr=0.1")) == str(tmp_path / "seed=0,lr=0.1")
    assert cell_dir(_sweep(tmp_path, "checkpoint=/w/a.pth")) == str(tmp_path / "checkpoint=") + "/w/a.pth"
    for leaving in ("../x", "a/../../x", "/etc", "seed=0\n"):
        with pytest.raises(ConfigError, match="outside the sweep's folder"):
            cell_dir(_sweep(tmp_path, leaving))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "seed=3").symlink_to(elsewhere)  # a cell's folder planted as a link: never written through
    with pytest.raises(ConfigError, match=r"sweep cell folder .*seed=3 is a symbolic link \(to "):
        cell_dir(_sweep(tmp_path, "seed=3"))


@pytest.mark.parametrize(
    "override", ["sweep_name=../..", "sweep_name=/tmp/elsewhere", "hydra.sweep.subdir=../../x", "hydra.sweep.subdir=/x"]
)
def test_where_a_sweep_goes_is_checked_before_hydra_makes_a_folder(override):
    """sweep_name and hydra.sweep.subdir name folders under outputs/<task>/sweeps/: a value that leaves it is refused
    from the command line, before Hydra makes the sweep's folder or a cell's."""
    (problem,) = command_line_problems(["-m", override, "seed=1,2"], ("sweep_name",))  # as the schema leaves it
    assert problem.startswith(f"{override}: {override.split('=')[0]} names a folder inside the sweeps' folder")
    assert command_line_problems(["-m", "sweep_name=table2/deit", "seed=1,2"], ()) == []


def test_a_value_that_resolves_outside_the_sweep_is_refused_as_it_resolves(monkeypatch):
    """An environment variable's interpolation is checked as it resolves; the separators Hydra joins a cell's
    overrides with into its folder's name may hold no '/' (each made folders of its own before the cell was
    refused, outside the sweep's with '..')."""
    monkeypatch.setenv("CAT_TEST_SUBDIR", "../../../../elsewhere")
    (problem,) = command_line_problems(["-m", "hydra.sweep.subdir=${oc.env:CAT_TEST_SUBDIR}", "seed=1,2"], ())
    assert "'../../../../elsewhere' would leave it" in problem
    for key in ("kv_sep", "item_sep"):
        override = f"hydra.job.config.override_dirname.{key}=/../../../../x"
        (problem,) = command_line_problems(["-m", override, "seed=1,2"], ())
        assert problem.startswith(f"{override}: joins a sweep cell's overrides into one folder name")
    monkeypatch.setenv("CAT_TEST_SEPARATOR", "/tmp")
    override = "hydra.job.config.override_dirname.kv_sep=${oc.env:CAT_TEST_SEPARATOR}"
    assert len(command_line_problems(["-m", override, "seed=1,2"], ())) == 1
    ok = ["hydra.job.config.override_dirname.kv_sep=-", "hydra.sweep.subdir=${hydra.job.num}", "seed=1,2"]
    assert command_line_problems(["-m", *ok], ()) == []  # the config's own interpolation: checked as the cell's


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
