"""The metric sinks: metrics.jsonl as a history any tool can read, and the fan-out every trainer uses."""

from __future__ import annotations

import json
import os
import re
import socket
import sys

import pytest

from cat.runtime.job_config import LoggerConfig, WandbConfig
from cat.runtime.metric_sinks import METRICS_HISTORY, JsonlSink, MetricSinks, build_metric_sinks, read_history
from tests import prewarmed
from tests.conftest import REPO


def logger_section(mode: str = "disabled") -> LoggerConfig:
    """The typed ``logger`` section a run hands its metric sinks."""
    return LoggerConfig(WandbConfig(mode=mode, project="p", entity=None, tags=[], name="n", group=None))


def test_history_lines_and_replayed_steps(tmp_path):
    path = tmp_path / METRICS_HISTORY
    sink = JsonlSink(str(path))
    sink.log({"train/loss": 2.0}, 10)
    sink.log({"train/loss": 1.5, "time": 0.3}, 20)  # a metric called "time" (mmengine's) stays a metric
    sink.log({"val/top1": float("nan")}, 20)
    sink.finish()
    # A resumed run replays step 20 (it was logged after the checkpoint it resumed from).
    sink = JsonlSink(str(path))
    sink.log({"train/loss": 1.4, "time": 0.2}, 20)
    sink.finish()
    with open(path, "a") as f:
        f.write('{"step": 30, "train/lo')  # a killed writer's torn line
    lines = [json.loads(line) for line in path.read_text().splitlines()[:4]]
    assert [e["step"] for e in lines] == [10, 20, 20, 20] and all("logged_at" in e for e in lines)
    assert lines[2]["val/top1"] == "nan"  # strict JSON
    history = read_history(path)
    assert [(e["step"], e.get("train/loss"), e.get("time")) for e in history] == [
        (10, 2.0, None),
        (20, 1.4, 0.2),
        (20, None, None),
    ]


def test_fan_out_and_ranks(tmp_path):
    sinks = build_metric_sinks(logger_section(), str(tmp_path), {}, is_main=True, training=True)
    assert [type(s).__name__ for s in sinks.sinks] == ["JsonlSink"]  # W&B disabled
    sinks.log({"a": 1.0}, 1)
    sinks.finish()
    sinks.finish()  # idempotent: the lifecycle finishes whatever the body did
    assert read_history(tmp_path / METRICS_HISTORY)[0]["a"] == 1.0
    other = build_metric_sinks(logger_section(), str(tmp_path / "nowhere"), {}, is_main=False, training=True)
    other.log({"a": 1.0}, 1)
    assert other.sinks == [] and not (tmp_path / "nowhere").exists()


def test_wandb_only_for_training_runs(tmp_path):
    logger = logger_section("offline")
    assert len(build_metric_sinks(logger, str(tmp_path), {}, is_main=True, training=False).sinks) == 1
    sinks = build_metric_sinks(logger, str(tmp_path), {}, is_main=True, training=True)
    assert [type(s).__name__ for s in sinks.sinks] == ["JsonlSink", "WandbSink"]
    assert sinks.sinks[1].run is None  # started at the first log only
    sinks.finish()
    assert isinstance(MetricSinks().sinks, list)


def test_no_file_until_the_first_line(tmp_path):
    """A run refused before it logs leaves no history behind (nothing it did not write)."""
    sink = JsonlSink(str(tmp_path / METRICS_HISTORY))
    sink.finish()
    assert not (tmp_path / METRICS_HISTORY).exists()


# W&B's service process ends under a started run, as Slurm ends every process of a step: during the run (the
# step's stop signal reaches it), or after the run finished (submitit requeues a preempted cell as it closes).
SERVICE_ENDS = """
import contextlib, os, signal, sys, time
from cat.runtime.logger import setup_logging
from cat.runtime.metric_sinks import build_metric_sinks
from tests.conftest import descendant_pids
from tests.runtime.test_metric_sinks import logger_section

def end_service():
    for pid in services:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    while set(services) & set(descendant_pids(os.getpid())):
        time.sleep(0.05)

setup_logging(True)
logger = logger_section("offline")
sinks = build_metric_sinks(logger, sys.argv[1], {}, is_main=True, training=True)
sinks.log({"a": 1.0}, 1)  # starts the W&B run and its service process
services = descendant_pids(os.getpid())
assert services, "W&B started no service process"
if sys.argv[2] == "during":
    end_service()
sinks.log({"a": 2.0}, 2)
sinks.log({"a": 3.0}, 3)
sinks.finish()
if sys.argv[2] == "after":
    end_service()
print("finished")
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["during", "after"])
def test_a_lost_wandb_service_ends_only_wandb(tmp_path, when):
    proc = prewarmed.run(
        [sys.executable, "-c", SERVICE_ENDS, str(tmp_path), when],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "finished" in proc.stdout, output
    # During the run: one warning naming where W&B stopped, at the first step (2) or, as W&B sends asynchronously,
    # the next one (3 in half the runs) or its finish (a loaded machine) that finds the connection gone. After it:
    # nothing to say. Never a traceback, not even from W&B's exit hook.
    warnings = 1 if when == "during" else 0
    where = re.findall(r"W&B stopped (at step [23]|while finishing) \(", output)
    assert len(where) == output.count("W&B stopped") == warnings, output
    assert output.count("metrics.jsonl has every metric") == warnings, output
    assert "Traceback" not in output and "Exception ignored" not in output, output
    assert [e["a"] for e in read_history(tmp_path / METRICS_HISTORY)] == [1.0, 2.0, 3.0]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # what W&B took before it ended


# A compute node without a route to W&B's server, whose shared home holds the user's API key: `auto` goes online.
UNREACHABLE_SERVER = """
import sys
from cat.runtime.logger import setup_logging
from cat.runtime.metric_sinks import build_metric_sinks
from tests.runtime.test_metric_sinks import logger_section

setup_logging(True)
logger = logger_section("auto")
sinks = build_metric_sinks(logger, sys.argv[1], {}, is_main=True, training=True)
for step in (1, 2, 3):
    sinks.log({"a": float(step)}, step)
sinks.finish()
print("finished")
"""


@pytest.mark.slow
def test_an_unreachable_wandb_server_leaves_the_run_offline(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_API_KEY="0" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{port}", WANDB_INIT_TIMEOUT="3")

    def start_the_run() -> str:
        proc = prewarmed.run(
            [sys.executable, "-c", UNREACHABLE_SERVER, str(tmp_path)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "finished" in proc.stdout and "Traceback" not in output, output
        assert "W&B stopped" not in output, output
        assert [e["a"] for e in read_history(tmp_path / METRICS_HISTORY)] == [1.0, 2.0, 3.0]  # replays: the later
        return output

    output = start_the_run()
    assert output.count("W&B could not start the run online (") == 1 and f"127.0.0.1:{port}" in output, output
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")  # the run, for `wandb sync`, under the folder's run id
    assert offline.name.endswith((tmp_path / "wandb_run_id.txt").read_text().strip())
    assert list(offline.glob("run-*.wandb"))
    # The run started again (a requeue on the same nodes) goes on offline at once, not after another init timeout.
    output = start_the_run()
    assert "could not start the run online" not in output and "this run has logged offline before" in output, output


LOG_ODD_NAME = """
import sys
from cat.runtime.logger import setup_logging
log = setup_logging(True, sys.argv[1])
log.warning("cannot read image %s", "/data/caf\\udce9.jpg")  # a name that is not UTF-8, as os.listdir returns it
log.error("error: the run's last line")
"""


def test_a_name_that_is_not_utf8_is_logged_escaped_and_the_log_keeps_its_last_line(tmp_path):
    proc = prewarmed.run(
        [sys.executable, "-c", LOG_ODD_NAME, str(tmp_path / "log.txt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert proc.returncode == 0 and "Logging error" not in proc.stderr, proc.stderr
    assert "caf\\udce9.jpg" in proc.stdout
    log = (tmp_path / "log.txt").read_text()
    assert "caf\\udce9.jpg" in log and log.rstrip().endswith("error: the run's last line")
