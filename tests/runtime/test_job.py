"""The job lifecycle at function level: the run folder and its lock, run_job's record, and what
happens when the body fails or the run already finished."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from cat.errors import DataError, RunDirLockedError
from cat.runtime import DistEnv, open_run_folder, run_job
from cat.runtime.metric_sinks import read_history
from tests import prewarmed
from tests.conftest import REPO, TINY_CLS, compose_config, run_folder, typed_config


def test_run_folder_is_created_locked_and_released(tmp_path):
    folder = open_run_folder(str(tmp_path / "run"), DistEnv())
    assert folder.path == str(tmp_path / "run") and (tmp_path / "run" / ".lock").is_file()
    with pytest.raises(RunDirLockedError, match="in use"):
        open_run_folder(str(tmp_path / "run"), DistEnv())
    folder.close()
    open_run_folder(str(tmp_path / "run"), DistEnv()).close()  # free again


def test_run_job_records_metrics_history_and_a_finished_run(tmp_path):
    cfg = typed_config("cls", *TINY_CLS, f"output_dir={tmp_path}")
    calls = []

    def body(env, folder):
        calls.append(folder.path)
        folder.write_config(cfg)
        folder.metrics.log({"val/top1": 50.0}, 3)
        return {"top1": 50.0}

    assert run_job(cfg, body) == {"top1": 50.0}
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"top1": 50.0}
    assert read_history(tmp_path / "metrics.jsonl")[0]["val/top1"] == 50.0
    assert not (tmp_path / ".lock").exists() or json.loads((tmp_path / ".lock").read_text()).get("pid") is None
    # The same config again: the finished record is returned, the body does not run.
    assert run_job(cfg, body) == {"top1": 50.0} and len(calls) == 1


@pytest.mark.parametrize(
    "error, recorded",
    [
        (DataError("broken image /data/x.jpg"), "error: broken image /data/x.jpg"),
        (KeyError("qkv.weight"), "the run ended with KeyError: 'qkv.weight'"),
    ],
    ids=["user error", "bug"],
)
def test_run_job_records_why_the_body_failed_and_releases_the_folder(tmp_path, capsys, error, recorded):
    cfg = typed_config("cls", *TINY_CLS, f"output_dir={tmp_path}")

    def body(env, folder):
        folder.metrics.log({"train/loss": 1.0}, 1)
        raise error

    with pytest.raises(type(error)):
        run_job(cfg, body)
    assert not (tmp_path / "metrics.json").exists()
    assert read_history(tmp_path / "metrics.jsonl")[0]["train/loss"] == 1.0  # what it logged stays
    # The run's record says how it ended; the console has its own line or traceback, not this one too.
    assert (tmp_path / "log.txt").read_text().splitlines()[-1].endswith(f"] {recorded}")
    assert recorded not in capsys.readouterr().out
    open_run_folder(str(tmp_path), DistEnv()).close()  # the lock was released


def test_a_folder_started_over_keeps_the_earlier_run_apart(tmp_path):
    """resume=false: the earlier run's files move into earlier_runs/<time>/, each start over its own, so none of them
    (a snapshot, a metric history, a W&B run id) mixes with the new run's; an empty folder moves nothing."""
    run_folder(tmp_path)
    for name, text in (("last.pth", "a"), ("metrics.jsonl", "{}"), ("wandb_run_id.txt", "abc")):
        (tmp_path / name).write_text(text)
    (tmp_path / "eval").mkdir()
    kept = []
    for _ in range(2):
        folder = open_run_folder(str(tmp_path), DistEnv(), start_over=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            ".cat-made",
            ".cat-run",
            ".lock",
            ".started_over",
            "earlier_runs",
            "log.txt",
        ]
        folder.close()
        kept = sorted((tmp_path / "earlier_runs").iterdir())
    first, second = kept  # the second start over kept the first's log.txt, in a folder of its own
    assert sorted(p.name for p in first.iterdir()) == ["eval", "last.pth", "metrics.jsonl", "wandb_run_id.txt"]
    assert (first / "wandb_run_id.txt").read_text() == "abc"
    assert sorted(p.name for p in second.iterdir()) == [".cat-made", "log.txt"]  # with its record of what it made
    assert f"the earlier run's files are in {second}" in (tmp_path / "log.txt").read_text()
    (tmp_path / "log.txt").unlink()
    open_run_folder(str(tmp_path), DistEnv(), start_over=True).close()
    assert len(list((tmp_path / "earlier_runs").iterdir())) == 2  # nothing there to set aside: no new folder


def _launch(monkeypatch, job: str | None = None, restarts: int = 0, run: str | None = None, elastic: int = 0) -> None:
    for name, value in (
        ("SLURM_JOB_ID", job),
        ("SLURM_RESTART_COUNT", str(restarts) if job else None),
        ("TORCHELASTIC_RUN_ID", run),
        ("TORCHELASTIC_RESTART_COUNT", str(elastic) if run else None),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("started_by", "relaunch", "goes_on"),
    [
        ({"job": "41"}, {"job": "41", "restarts": 1}, "Slurm job 41, now in its restart 1 (requeued)"),
        ({"job": "41", "restarts": 1}, {"job": "41", "restarts": 3}, "Slurm job 41, now in its restart 3"),
        ({"run": "r7"}, {"run": "r7", "elastic": 2}, "torchrun run r7, now in its worker restart 2"),
        ({"job": "41", "run": "41"}, {"job": "41", "run": "41", "elastic": 1}, "torchrun run 41"),
        ({"job": "41"}, {"job": "41"}, None),  # launched again by hand in the same allocation: starts over
        ({"job": "41"}, {"job": "42", "restarts": 1}, None),  # another job
        ({"job": "41", "restarts": 2}, {"job": "41", "restarts": 1}, None),
        ({}, {}, None),  # no Slurm, no torchrun: every launch is by hand
        ({"run": "r7"}, {"run": "r8", "elastic": 1}, None),  # another torchrun
        ({"job": "41", "run": "41"}, {"job": "41", "restarts": 1, "run": "41", "elastic": 0}, "Slurm job 41"),
        ({"job": "41", "run": "41", "elastic": 1}, {"job": "41", "restarts": 0, "run": "41", "elastic": 1}, None),
    ],
)
def test_a_relaunch_of_a_run_started_over_goes_on_with_it(tmp_path, monkeypatch, started_by, relaunch, goes_on):
    """resume=false starts the folder over once per launch: the same command requeued by Slurm (or its workers
    restarted by torchrun) goes on with the run that launch started, rather than starting it over at every
    requeue; a new launch, even by hand inside the same Slurm allocation, starts over as asked."""
    from cat.runtime import typed_job_config
    from cat.runtime.schema import schema_of

    (run_folder(tmp_path) / "last.pth").write_text("the earlier run")
    _launch(monkeypatch, **started_by)
    open_run_folder(str(tmp_path), DistEnv(), start_over=True).close()
    (tmp_path / "last.pth").write_text("this launch's run")
    _launch(monkeypatch, **relaunch)
    cfg, notes = typed_job_config(
        compose_config("cls", *TINY_CLS, f"output_dir={tmp_path}", "resume=false"), schema_of("cls")
    )
    assert cfg.resume is (goes_on is not None)
    if goes_on is None:
        assert notes == []
        return
    [note] = notes
    assert note.startswith(f"resume=false: this folder's run was started over by {goes_on}"), note
    assert note.endswith("; it goes on with that run (resume=true)"), note
    folder = open_run_folder(str(tmp_path), DistEnv(), start_over=not cfg.resume, notes=notes)
    folder.close()
    assert (tmp_path / "last.pth").read_text() == "this launch's run"
    assert len(list((tmp_path / "earlier_runs").iterdir())) == 1  # only the first launch's start over
    assert note in (tmp_path / "log.txt").read_text()


def test_settling_the_folder_leaves_other_runs_as_they_are(tmp_path, monkeypatch):
    """Only a training run with resume=false reads the launch record: an eval of the folder, or a resume=true
    run, does not, even where it is damaged."""
    from cat.runtime import typed_job_config
    from cat.runtime.schema import schema_of

    (tmp_path / ".started_over").write_text("not json")
    _launch(monkeypatch, job="41", restarts=1)
    for overrides in (["mode=eval", "resume=false"], ["resume=true"]):
        raw = compose_config("cls", *TINY_CLS, f"output_dir={tmp_path}", *overrides)
        cfg, notes = typed_job_config(raw, schema_of("cls"))
        assert notes == [] and cfg.resume == raw.resume


# Two ranks of a real gloo group; rank 1 joins, then never reaches the collective (a lost node, as seen
# from rank 0). Started as two processes, not through torchrun, which would kill rank 0 once rank 1 ends.
LOST_PEER = """
import os, sys, time
import torch, torch.distributed as dist
from cat.runtime import run_job
from tests.conftest import TINY_CLS, typed_config

cfg = typed_config("cls", *TINY_CLS, "output_dir=" + sys.argv[1], "dist_timeout_s=3")

def body(env, folder):
    if env.rank == 1:
        time.sleep(120)
    dist.all_reduce(torch.ones(1))
    return {}

run_job(cfg, body)
"""


@pytest.mark.slow
def test_a_rank_left_waiting_for_a_lost_peer_says_so_in_the_run_log(tmp_path):
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [
        prewarmed.Popen(
            [sys.executable, "-c", LOST_PEER, str(tmp_path / "run")],
            cwd=REPO,
            env={**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out, _ = ranks[0].communicate(timeout=120)
    finally:
        ranks[1].kill()
    assert ranks[0].returncode != 0
    record = (tmp_path / "run" / "log.txt").read_text()
    assert "rank 0 of 2: a collective failed, another rank stopped answering" in record, out[-2000:]
    assert "dist_timeout_s=3" in record and "Timed out waiting" in record


def test_a_job_releases_what_it_compiled_so_the_next_cell_starts_clean(tmp_path):
    """Hydra's basic launcher runs a multirun's cells in one process: each job resets the compiler as it ends (its
    compiled code and the CUDA graphs' pool), so a function the cell compiled is compiled afresh by the next."""
    import torch

    compilations = []

    def counting(graph, inputs):
        compilations.append(graph)
        return graph.forward

    doubled = torch.compile(lambda x: x * 2, backend=counting)

    def body(env, folder):
        doubled(torch.ones(3))
        doubled(torch.ones(3))  # the same shapes: no recompilation within the cell
        return {"top1": 1.0}

    for cell in ("a", "b"):
        run_job(typed_config("cls", *TINY_CLS, f"output_dir={tmp_path / cell}"), body)
    assert len(compilations) == 2
