"""Hydra multirun sweeps through submitit's local launcher (real processes, real submitit), the
sweep table of tools/make_tables.py, and the sbatch script a Slurm sweep would submit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S
from tests.subprocess_output import output_tail

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher not installed")

# Two models x two seeds of a tiny digits classifier (patch 4 on 32x32, 48 channels, 2 blocks).
KWARGS = "++model.kwargs={embed_dim:48,depth:2,patch_size:4}"  # as it names the cells
TINY = [KWARGS, "logger.wandb.mode=disabled", "workers=0"]


def sweep(
    sweep_dir: Path, *overrides: str, wait: bool = True, launcher: str = "submitit_local"
) -> prewarmed.ForkedProcess | subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(REPO / "train_cls.py"),
        "-m",
        f"hydra/launcher={launcher}",
        *TINY,
        *overrides,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    # submitit's cells are forked by the prewarmed interpreter too (its job controller stays a process of its own).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAT_TEST_FORK_CHILDREN": "1"}
    if not wait:
        return prewarmed.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc = prewarmed.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TOY_RUN_S)
    except subprocess.TimeoutExpired as error:
        error.add_note(cell_logs(sweep_dir))
        raise
    assert proc.returncode == 0, output_tail(proc) + "\n" + cell_logs(sweep_dir)
    return proc


def cell_logs(sweep_dir: Path, chars: int = 2000) -> str:
    """The end of each cell task's own log (submitit's, under the sweep), where a cell says why it failed."""
    logs = sorted((sweep_dir / ".submitit").glob("*/*_log.*"))
    return "\n".join(
        f"--- {log.relative_to(sweep_dir)} ---\n{log.read_text(errors='replace')[-chars:]}" for log in logs
    )


def cells(sweep_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in sweep_dir.iterdir() if (p / "overrides.yaml").is_file()}


@pytest.mark.slow
def test_two_models_two_seeds_sweep_and_its_table(run_tool, tmp_path):
    sweep(tmp_path, "model=ca_deit_tiny,deit_tiny", "seed=0,1", "epochs=2")
    folders = cells(tmp_path)
    names = {(m, s): f"{KWARGS},epochs=2,model={m},seed={s}" for m in ("ca_deit_tiny", "deit_tiny") for s in (0, 1)}
    assert sorted(folders) == sorted(names.values())
    for cell, folder in folders.items():
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["epoch"] == 2 and not metrics.get("preempted")
        # Its W&B run is told apart from the other cells' (the same experiment name) and grouped by the sweep.
        wandb = OmegaConf.load(folder / "config.yaml").logger.wandb
        assert (wandb.name, wandb.group) == (f"quickstart_digits/{cell}", "sweep")

    text = run_tool("make_tables", str(tmp_path), "--csv", str(tmp_path / "sweep.csv"))
    rows = [line for line in text.splitlines() if line.startswith(f"| {KWARGS}")]
    assert [r.split("|")[1].strip() for r in rows] == [
        f"{KWARGS},epochs=2,model={m}" for m in ("ca_deit_tiny", "deit_tiny")
    ]
    for row, model in zip(rows, ("ca_deit_tiny", "deit_tiny"), strict=True):
        top1 = [json.loads((folders[names[model, s]] / "metrics.json").read_text())["val/best_top1"] for s in (0, 1)]
        mean, std = sum(top1) / 2, abs(top1[0] - top1[1]) / 2**0.5
        assert f"| 2 | {mean:.2f} ± {std:.2f} |" in row and row.rstrip(" |").endswith("2 finished")
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 3  # header + two groups


@pytest.mark.slow
def test_a_killed_cell_resumes_when_the_sweep_is_relaunched(run_tool, tmp_path):
    overrides = ("seed=0,1", "epochs=3", "batch_size=16")
    launcher = sweep(tmp_path, *overrides, wait=False)
    victim = tmp_path / f"{KWARGS},batch_size=16,epochs=3,seed=1"
    deadline = time.monotonic() + 300
    while not (victim / "last.pth").is_file():  # killed after its first epoch, mid-way through the second
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.stdout.read()[-3000:]
        time.sleep(0.2)
    os.kill(json.loads((victim / ".lock").read_text())["pid"], signal.SIGTERM)
    assert launcher.wait(timeout=300) == 0, launcher.stdout.read()[-3000:]
    stopped = json.loads((victim / "metrics.json").read_text())
    assert stopped["preempted"] and stopped["epoch"] < 3
    survivor = tmp_path / f"{KWARGS},batch_size=16,epochs=3,seed=0"
    assert json.loads((survivor / "metrics.json").read_text())["epoch"] == 3
    text = run_tool("make_tables", str(tmp_path))
    assert "1 finished, 1 stopped (stopped at step " in text and ", top1 " in text  # from its metrics.jsonl

    untouched = {p.name: p.stat().st_mtime_ns for p in survivor.iterdir() if p.name != "log.txt"}
    sweep(tmp_path, *overrides)
    assert {p.name: p.stat().st_mtime_ns for p in survivor.iterdir() if p.name != "log.txt"} == untouched
    resumed = json.loads((victim / "metrics.json").read_text())
    assert resumed["epoch"] == 3 and not resumed.get("preempted")
    log = (victim / "log.txt").read_text()
    assert "stop requested" in log and "resumed from" in log
    assert "2 finished" in run_tool("make_tables", str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["submitit_local", "basic"])
def test_a_cell_with_a_user_error_fails_alone_and_the_sweep_says_why(run_tool, tmp_path, launcher):
    """The bad cell first: the sweep's other cell still trains (in-process, one cell's exit ended them all), and
    the sweep ends with the bad cell's one line and status 2, not submitit's traceback around it (a cell that
    exited wrote no result, which submitit waited for, and on a Slurm without accounting forever). Refused
    before its run opened a folder, the cell still leaves its line there: the sweep's table counts it as
    failed, saying why, not as never started. The sweep's last lines name every failed cell, Hydra's first last."""
    proc = sweep(tmp_path, "lr=-1,1e-3,-2", "epochs=1", wait=False, launcher=launcher)
    output = proc.communicate(timeout=TOY_RUN_S)[0]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    bad = f"{KWARGS},epochs=1,lr=-1"
    line = "invalid config: lr=-1: expected a number > 0 and <= 1e+06"
    assert output.rstrip().splitlines()[-2:] == [
        f"error: sweep cell {KWARGS},epochs=1,lr=-2: invalid config: lr=-2: expected a number > 0 and <= 1e+06",
        f"error: sweep cell {bad}: {line}",
    ]
    good = tmp_path / f"{KWARGS},epochs=1,lr=0.001"
    assert json.loads((good / "metrics.json").read_text())["epoch"] == 1
    assert not (good / ".lock").exists(), (good / "log.txt").read_text()[-2000:]  # it ended as a run ends
    assert sorted(p.name for p in (tmp_path / bad).iterdir()) == ["log.txt", "overrides.yaml"]
    (row,) = [line for line in run_tool("make_tables", str(tmp_path)).splitlines() if "lr=-1" in line]
    assert row.rstrip(" |").endswith(f"1 failed (failed, its log ends: error: {line})"), row


@pytest.mark.slow
def test_a_cell_named_out_of_the_sweep_folder_is_refused_before_any_cell_runs(tmp_path):
    """``name=x/../../elsewhere``: the cell's folder would resolve outside ``hydra.sweep.dir``; the sweep is refused
    in one line before Hydra expands it, and nothing is made anywhere (Hydra makes a cell's folder itself)."""
    escape = "x/" + "../" * 3 + "elsewhere"
    proc = sweep(tmp_path / "sweeps" / "s", f"name={escape},y", "epochs=1", wait=False, launcher="basic")
    output = proc.communicate(timeout=TOY_RUN_S)[0]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert output.rstrip().splitlines()[-1] == (
        f"error: name={escape},y: the value {escape!r} names sweep cells, and its '..' or control characters would "
        "put a cell's folder outside the sweep's folder"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["seed=range(0,10,0)"], "seed=range(0,10,0): a range needs a finite start and stop and a step other than 0"),
        (["seed=range(0,inf)"], "seed=range(0,inf): a range needs a finite start and stop"),
        (["lr=interval(0,1)"], "lr=interval(0,1): interval() is a search space for optimizing sweepers (Optuna, Ax)"),
        (["seed=range(0,100000)"], "the sweep expands to 100000 cells, over 10000"),
        (
            [
                "seed=range(0,200)",
                "lr=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51",
            ],
            "the sweep expands to 10200 cells",
        ),
        (["name=a/../b"], "the value 'a/../b' names sweep cells"),
        (["name=ok\x07,fine"], None),  # not an override Hydra parses: its own refusal, one line too
        (["data.root=/a,/b"], "data.root=/a,/b: data.root does not name a sweep's cells, so its values would share"),
        (["data.root=/x/../y", "seed=0,1"], None),  # one value of a key that names no cell: every cell's
        (["hydra.sweep.dir=/a/../b", "seed=0,1"], None),
        (["hydra.sweep.dir=/proc/cat/s", "seed=0,1"], "hydra.sweep.dir=/proc/cat/s: cannot write in /proc"),
        (["hydra.run.dir=/proc/cat"], "hydra.run.dir=/proc/cat: cannot write in /proc"),
    ],
)
def test_a_sweeps_command_line_is_checked_before_it_expands(overrides, problem):
    from cat.classification.schema import ClsConfig
    from cat.runtime.cells import command_line_problems
    from cat.runtime.config_help import unnamed_keys

    problems = command_line_problems(["-m", *overrides], unnamed_keys(ClsConfig))
    assert (problems == []) if problem is None else any(p.startswith(problem) or problem in p for p in problems), (
        problems
    )


@pytest.mark.slow
def test_cell_with_two_tasks_runs_distributed_without_torchrun(tmp_path):
    # A rank that cannot meet the other ends its cell within dist_timeout_s, inside the test's bound.
    sweep(tmp_path, "hydra.launcher.tasks_per_node=2", "epochs=1", "seed=0", "dist_timeout_s=120")
    (folder,) = cells(tmp_path).values()
    assert "(world size 2: " in (folder / "log.txt").read_text()
    assert json.loads((folder / "metrics.json").read_text())["epoch"] == 1


def test_slurm_preview_of_a_two_node_eight_gpu_cell(run_tool):
    text = run_tool(
        "slurm_preview",
        "train_cls.py",
        "hydra/launcher=slurm",
        "cluster.partition=gpu",
        "cluster.nodes=2",
        "cluster.gpus_per_node=8",
        "experiment=ca_deit_t,deit_t",
        "seed=0,1",
        "data.root=/data/imagenet",
    )
    assert text.startswith("4 cells, one Slurm job each")
    for line in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--time=4320",
        "--signal=USR2@300",
        "--cpus-per-task=10",
    ):
        assert f"#SBATCH {line}\n" in text
    assert "export SUBMITIT_EXECUTOR=slurm" in text and "srun" in text


@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "configs" / "cls" / "sweep").glob("*.yaml")))
def test_sweep_presets_name_existing_experiments(preset):
    from tests.conftest import compose_config

    cfg = compose_config("cls", f"sweep={preset}")
    assert cfg.sweep_name == preset
    experiments = str(OmegaConf.select(compose_hydra(preset), "hydra.sweeper.params.experiment")).split(",")
    assert len(experiments) >= 3
    for experiment in experiments:
        assert (REPO / "configs" / "cls" / "experiment" / f"{experiment}.yaml").is_file(), experiment


def compose_hydra(preset: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs" / "cls"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"sweep={preset}"], return_hydra_config=True)


def test_slurm_preview_expands_a_preset_with_a_seeds_axis(run_tool):
    text = run_tool("slurm_preview", "train_cls.py", "hydra/launcher=slurm", "sweep=table5_ablation", "seed=0,1,2")
    assert text.startswith("18 cells") and "experiment=table5_deit_s_reweight seed=2" in text
