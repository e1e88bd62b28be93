from __future__ import annotations

import gc
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import prewarmed
from tests.subprocess_output import pytest_runtest_makereport  # noqa: F401 (a hook: a failed command's output shown)

# pytest-xdist's workers (a worker per core and one more): each takes its share of the cores (one thread at least),
# and so do the processes it starts, so that OpenMP threads do not spin against each other's.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Ctrl-C as a terminal delivers it. A shell starts a background job (`pytest &` in a script) with SIGINT ignored;
# the tests' processes and the runs they start would inherit that and keep it (cat leaves an ignored SIGINT ignored).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
# Read-only fixtures beside the checkout in development and CI; absent on users' machines.
SHARED = REPO.parent / "shared"
# The bound on one toy run a test starts (training, a tool, a sweep): they take 5 to 40 s here, up to three times
# that on a slow or loaded machine; a hang fails within this, not after a blanket 10 or 15 minutes.
TOY_RUN_S = 300
OFFICIAL_CA_DEIT = SHARED / "fixtures" / "official_ca_deit"
# A tiny CA-DeiT on learnable synthetic data (train_cls.py overrides): seconds per run on one thread.
TINY_CLS = [
    "data=synthetic",
    "data.img_size=32",
    "model.kwargs={embed_dim:16,depth:1,patch_size:8}",
    "aug=none",
    "workers=0",
    "logger.wandb.mode=disabled",
]
# With TINY_CLS: a softmax DeiT converted to circulant attention (cat.convert), at a width of its own.
TINY_CONVERTED = [
    "model.name=deit_tiny_patch16_224",
    "model.kwargs={embed_dim:24,depth:1,patch_size:8}",
    "model.convert={}",
]


def quick_few(names: list[str], quick: set[str]) -> list:
    """``names`` as test parameters, those not in ``quick`` marked slow: the quick tier checks one of each kind
    (e.g. the smallest model of each family), the full suite every one."""
    return [name if name in quick else pytest.param(name, marks=pytest.mark.slow) for name in names]


# The model of each family the quick tier checks (the full suite checks every registered model).
QUICK_MODELS = {
    "ca_deit_tiny",
    "ca_pvt_tiny",
    "ca_swin_tiny",
    "cat_tiny",
    "pvt_tiny",
    "deit_small_reweight_patch16_224",
}


# Where the tests' folders go: a RAM disk with room (Linux's /dev/shm), unless --basetemp or PYTEST_DEBUG_TEMPROOT
# says otherwise. The suite writes about 8 GB (toy detectors' checkpoints with their optimizer state, run folders);
# on the development and CI machines' disk each new megabyte written cost ~12 ms of kernel CPU, 2 s for one
# 150 MB checkpoint, against 0.5 ms on tmpfs. A passed test's folder is removed as it ends
# (tmp_path_retention_policy = "failed" in pyproject.toml), so the RAM held stays near 1.3 GB.
RAM_DISK = Path("/dev/shm")
RAM_DISK_ROOM = 4 << 30


def ram_disk_has_room(path: Path = RAM_DISK, room: int = RAM_DISK_ROOM) -> bool:
    """Whether ``path`` is a folder this user can write with at least ``room`` bytes free."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return False
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK) and stats.f_bavail * stats.f_frsize >= room


def pytest_configure(config: pytest.Config) -> None:
    if config.option.basetemp is None and "PYTEST_DEBUG_TEMPROOT" not in os.environ and ram_disk_has_room():
        os.environ["PYTEST_DEBUG_TEMPROOT"] = str(RAM_DISK)  # read when the first folder is made


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the suite also runs without the plugin
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker more than the cores (``-n auto``; ``--maxprocesses`` still caps it): a good part of the suite
    waits rather than computes (the Slurm file on its jobs, the signal tests on their runs). With a worker per
    core, a core sat idle while its worker waited: 161 of 1,840 core-seconds on 2 cores, 47 with a third worker."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Slurm tests first (with ``--no-loadscope-reorder``, xdist hands out the files in this order): their
    jobs mostly wait on the cluster, so they overlap the other workers' files instead of running at the end."""
    items.sort(key=lambda item: 0 if "tests/slurm/" in item.nodeid else 1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, timm, the OpenMMLab stack) out of the garbage collector's sight: a full
    collection (mmengine's datasets ask for one each; the interpreter's own every so often) then walks only what
    the tests made, not the stack's million objects, which live as long as the worker does anyway."""
    gc.freeze()


def pytest_report_header() -> str:
    """The versions this run tests (the pins in requirements*.txt are the set CI runs)."""
    import importlib.metadata as md

    names = (
        "torch",
        "torchvision",
        "timm",
        "pillow",
        "numpy",
        "hydra-core",
        "mmengine",
        "mmcv",
        "mmdet",
        "mmsegmentation",
    )
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            found.append(f"{name} -")
    return "cat test stack: " + ", ".join(found)


def refusal_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused run ends with: exit status 2, no traceback, ``error: ...`` last."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    return last


def descendant_pids(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux ``/proc``), children before grandchildren: the
    processes Slurm signals with a job step's own, whatever session they started."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ")".
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state != "Z":  # an ended process its parent has not waited for yet
            parents[int(stat.parent.name)] = int(ppid)
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.fixture
def outside_dir() -> Iterator[Path]:
    """A folder outside every folder a confined run may write by default (the temporary folder, /dev, the caches):
    a new one under /var/tmp, removed afterwards."""
    from cat.runtime.confine import Confinement, writable_folders

    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("no writable /var/tmp for a folder outside a confined run's reach")
    path = Path(tempfile.mkdtemp(prefix="cat-outside-", dir="/var/tmp"))
    try:
        if Confinement(tuple(writable_folders("/nonexistent-run", gpu=True))).allows(str(path)):
            pytest.skip(f"{path} lies in a folder a confined run may write")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_folder(path: Path) -> Path:
    """``path`` made as a cat run's folder (its marker written), for a test that puts a run's files there by hand."""
    from cat.runtime.ownership import RUN_MARKER

    path.mkdir(parents=True, exist_ok=True)
    (path / RUN_MARKER).write_text('{"cat_run": 1}\n')
    return path


def compose_config(task: str, *overrides: str):
    """The Hydra config ``train_<task>.py`` would run with ``overrides`` (task: cls, det or seg); unconfined
    (``run.confine=false``) unless an override says otherwise: a run in the test's own process would confine the
    worker that runs the next tests, for good. Runs of the scripts in their own processes are confined."""
    from hydra import compose, initialize_config_dir

    if not any(override.startswith("run.confine=") for override in overrides):
        overrides = ("run.confine=false", *overrides)
    with initialize_config_dir(config_dir=str(REPO / "configs" / task), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def checked_config(task: str, *overrides: str):
    """The config ``train_<task>.py`` would run with ``overrides``, as the job checks it: typed and settled
    (:func:`cat.runtime.cells.typed_job_config`), then the task's own checks (ConfigError: every problem)."""
    from cat.runtime.cells import typed_job_config
    from cat.runtime.schema import schema_of

    typed, _ = typed_job_config(compose_config(task, *overrides), schema_of(task))
    if task == "cls":
        from cat.classification.checks import check_config

        return check_config(typed)
    from cat.mm.checks import check_mm_config

    return check_mm_config(typed)


def typed_cls(*overrides: str):
    """The classification config ``train_cls.py`` would run with ``overrides``, checked against its schema and
    typed: what a run hands its components (each its own section)."""
    return as_typed(compose_config("cls", *overrides), "cls")


def as_typed(cfg, task: str):
    """A composed config of ``task`` as the schema's typed object (what the trainers read once it is checked)."""
    from cat.runtime.schema import schema_of, typed_config

    return typed_config(cfg, schema_of(task))


def typed_config(task: str, *overrides: str):
    """:func:`compose_config`'s config as the schema's typed object."""
    return as_typed(compose_config(task, *overrides), task)


def mm_builder(task: str):
    """``(composed config, env, output folder) -> mmengine config`` of the detection or segmentation task."""
    from cat.mm import DET, SEG

    return lambda cfg, env, out: {"det": DET, "seg": SEG}[task].build_config(as_typed(cfg, task), env, out)


@pytest.fixture
def official_ca_deit() -> Path:
    if not (OFFICIAL_CA_DEIT / "small_p8_64.pth").is_file():
        pytest.skip("../shared/fixtures/official_ca_deit is not present")
    return OFFICIAL_CA_DEIT


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def run_tool(capsys):
    """Run ``tools/<name>.py`` in this process with ``args``; return its stdout."""

    def run(name: str, *args: str, expect: int = 0, stderr: bool = False, forked_workers: bool = False) -> str:
        """``stderr=True``: return what it wrote to stderr instead. ``forked_workers``: the Python processes the
        tool starts (a bench tool's workers, one per measurement) are forked by the prewarmed server."""
        argv, executable = sys.argv, sys.executable
        sys.argv = [f"{name}.py", *args]
        if forked_workers:
            sys.executable = prewarmed.python()
        try:
            with pytest.raises(SystemExit) as code:
                runpy.run_path(str(REPO / "tools" / f"{name}.py"), run_name="__main__")
        finally:
            sys.argv, sys.executable = argv, executable
        captured = capsys.readouterr()
        assert code.value.code == expect, captured.err[-2000:]
        return captured.err if stderr else captured.out

    return run


def _toy_dataset(tmp_path_factory, tool: str, *args: str) -> Path:
    root = tmp_path_factory.mktemp(tool)
    prewarmed.run(
        [sys.executable, str(REPO / "tools" / f"make_{tool}.py"), str(root), *(args or ("--train", "8", "--val", "4"))],
        check=True,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="session")
def toy_imagenet(tmp_path_factory) -> Path:
    """A user's first real folder: 6 classes, 300 train / 60 val JPEGs of ~500x375."""
    return _toy_dataset(tmp_path_factory, "toy_imagenet", "--train", "50", "--val", "10")


@pytest.fixture(scope="session")
def toy_coco(tmp_path_factory) -> Path:
    return _toy_dataset(tmp_path_factory, "toy_coco")


@pytest.fixture(scope="session")
def toy_ade(tmp_path_factory) -> Path:
    return _toy_dataset(tmp_path_factory, "toy_ade")
