"""A run's output folder: checked writable, held exclusively, cleaned of killed writers' leftovers.

Only one live run may write a folder. The holder is recorded in ``.lock`` (host, pid, process start
time, Slurm job id); a second run fails at once naming the holder. A lock left by a run that died
(SIGKILL, node crash) is taken over when its process is gone from this host, or when it belongs to
an earlier incarnation of the same Slurm job (a requeued job).

A run that starts the folder over (``resume=false``) records which launch did (``.started_over``): the
Slurm job and its restart count, torchrun's run and its restart count. A later start of that launch (the
job requeued, torchrun restarting its workers) goes on with the run instead of starting it over again.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
from typing import Any

from cat.errors import OutputError, RunDirLockedError

from .io import atomic_write_json, remove_stale_temporaries

__all__ = [
    "RunDirLock",
    "check_writable",
    "LOCK_NAME",
    "EARLIER_RUNS",
    "STARTED_OVER",
    "launch_record",
    "read_started_over",
    "relaunch_of",
]

LOCK_NAME = ".lock"
EARLIER_RUNS = "earlier_runs"  # where a run started over with resume=false keeps the folder's earlier run
STARTED_OVER = ".started_over"  # the launch that started the folder's run over (resume=false)
_LAUNCH_KEYS = {"slurm_job_id": str, "slurm_restarts": int, "torchelastic_run_id": str, "torchelastic_restarts": int}


def _restarts(variable: str) -> int:
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() else 0


def launch_record() -> dict[str, Any]:
    """This process's launch: its Slurm job and how often Slurm has restarted it (requeues), torchrun's run
    and how often torchrun has restarted its workers (None and 0 outside them)."""
    return {
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restarts": _restarts("SLURM_RESTART_COUNT"),
        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "torchelastic_restarts": _restarts("TORCHELASTIC_RESTART_COUNT"),
    }


def relaunch_of(record: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the launch ``now`` is a later start of the launch ``record``: the same Slurm job, requeued since,
    or the same torchrun run (in the same start of the same job, if any) whose workers it has restarted since.
    A second launch by hand is neither, even within one Slurm allocation."""
    same_job = now["slurm_job_id"] == record["slurm_job_id"]
    if same_job and now["slurm_job_id"] is not None and now["slurm_restarts"] > record["slurm_restarts"]:
        return True
    return (
        same_job
        and now["slurm_restarts"] == record["slurm_restarts"]
        and now["torchelastic_run_id"] is not None
        and now["torchelastic_run_id"] == record["torchelastic_run_id"]
        and now["torchelastic_restarts"] > record["torchelastic_restarts"]
    )


def _json_head(path: str) -> tuple[str, Any]:
    """The first 4 KiB of a small JSON record cat keeps in a run folder, and its value (ValueError if it is none)."""
    with open(path, "rb") as f:
        text = f.read(4096).decode("utf-8", errors="replace")
    return text, json.loads(text)


def read_started_over(folder: str) -> dict[str, Any] | None:
    """The launch that started ``folder``'s run over, from its ``.started_over`` record; None where it has none.
    A file there that is not cat's record is refused by name."""
    path = os.path.join(folder, STARTED_OVER)
    if not os.path.lexists(path):
        return None
    try:
        record = None if os.path.islink(path) else _json_head(path)[1]
    except (OSError, ValueError):  # a folder, unreadable, no JSON
        record = None
    if not (
        isinstance(record, dict)
        and record.keys() >= _LAUNCH_KEYS.keys()
        and all(
            (record[k] is None and kind is str) or (type(record[k]) is kind and record[k] != "")
            for k, kind in _LAUNCH_KEYS.items()
        )
    ):
        raise OutputError(
            f"{path} is not cat's record of the launch that started this run over (resume=false); remove it, "
            "or pass resume=true to go on with the run in the folder"
        )
    return {k: record[k] for k in _LAUNCH_KEYS}


def check_writable(folder: str, key: str = "output_dir") -> str | None:
    """None if ``folder`` exists or can be created and a file can be written in it, else the problem.

    It really writes (and removes) a probe file: permission bits say nothing for root, and nothing
    for read-only or full filesystems.
    """
    probe_dir = os.path.abspath(folder)
    if os.path.islink(probe_dir) and not os.path.exists(probe_dir):
        return f"{key}={folder}: a symbolic link to {os.readlink(probe_dir)}, which does not exist"
    while not os.path.exists(probe_dir):  # the nearest existing ancestor decides whether it can be created
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        return f"{key}={folder}: {probe_dir} is a file, not a folder"
    try:
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".cat-write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        return f"{key}={folder}: cannot write in {probe_dir} ({error.strerror or error})"
    return None


def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live holder from a new process with a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """Exclusive hold on ``folder`` for one run; ``with RunDirLock(folder):`` or acquire()/release()."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.held = False
        self.notes: list[str] = []  # what acquiring did (a stale lock taken over, leftovers removed), to log

    def _record(self) -> dict[str, Any]:
        pid = os.getpid()
        return {
            "host": socket.gethostname(),
            "pid": pid,
            "start_time": _process_start_time(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def _stale_reason(self, holder: dict[str, Any] | None) -> str | None:
        if holder is None:  # unreadable: a writer killed between creating and filling it
            return "unreadable" if time.time() - os.path.getmtime(self.path) > 30 else None
        job = os.environ.get("SLURM_JOB_ID")
        if job and holder.get("slurm_job_id") == job and holder.get("pid") != os.getpid():
            return f"left by an earlier run of Slurm job {job}"
        if holder.get("host") != socket.gethostname():
            return None  # another machine's process cannot be checked from here
        pid = holder["pid"]
        if not _pid_alive(pid):
            return f"its process {pid} is gone"
        if holder.get("start_time") and _process_start_time(pid) != holder["start_time"]:
            return f"its process {pid} is gone (the pid now belongs to another process)"
        return None

    def in_use(self) -> bool:
        """Whether a live run holds the folder now (a stale lock does not count)."""
        return os.path.lexists(self.path) and self._stale_reason(self._read_holder()) is None

    def _read_holder(self) -> dict[str, Any] | None:
        """The holder's record; None while it is empty or half-written (a writer killed between
        creating and filling it). Anything else that is not a record of :meth:`_record`'s shape is
        refused: it is not cat's lock, and guessing whether a run holds the folder could lose one."""
        if os.path.islink(self.path) or not os.path.isfile(self.path):
            kind = "symbolic link" if os.path.islink(self.path) else "folder or special file"
            raise RunDirLockedError(
                f"{self.path} is a {kind}, not cat's lock file; remove it if no run is using {self.folder}"
            )
        try:
            text, holder = _json_head(self.path)
        except (OSError, ValueError):
            return None
        pid = holder.get("pid") if isinstance(holder, dict) else None
        if not (type(pid) is int and 0 < pid < 2**31 and isinstance(holder.get("host"), str)):
            raise RunDirLockedError(
                f"{self.path} holds {text[:80]!r}, not cat's lock record (host, pid); remove it if no run is "
                f"using {self.folder}"
            )
        return holder

    def acquire(self) -> RunDirLock:
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_holder()
                reason = self._stale_reason(holder)
                if reason is None:
                    who = (
                        f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
                        + (f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else "")
                        if holder
                        else "a run that is still starting"
                    )
                    raise RunDirLockedError(
                        f"output_dir {self.folder} is in use by another run ({who}); wait for it, choose another "
                        f"output_dir, or delete {self.path} if you are sure that run is dead"
                    ) from None
                self.notes.append(f"took over the stale lock {self.path} ({reason})")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
            self.held = True
            self.notes += [
                f"removed {path}, left by a writer that was killed" for path in remove_stale_temporaries(self.folder)
            ]
            return self
        raise RunDirLockedError(f"could not take the lock {self.path}: other runs keep racing for it")

    def set_aside_earlier_run(self) -> str | None:
        """Start the held folder over (``resume=false``): move everything in it but the lock into
        ``earlier_runs/<time>/``, so the earlier run's record and checkpoints are kept and none of them mixes with
        the new run's (a snapshot, a metric history, a W&B run id), and record this launch as the one that started
        it over. Returns where the earlier run went, None if the folder held none."""
        assert self.held, "set_aside_earlier_run needs the lock"
        # The launch record is the start over's own bookkeeping: replaced below, not kept.
        entries = sorted(
            name for name in os.listdir(self.folder) if name not in (LOCK_NAME, EARLIER_RUNS, STARTED_OVER)
        )
        target = None
        if entries:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            target = os.path.join(self.folder, EARLIER_RUNS, stamp)
            for n in range(1, 1000):  # two starts over within one second
                if not os.path.exists(target):
                    break
                target = os.path.join(self.folder, EARLIER_RUNS, f"{stamp}-{n}")
            os.makedirs(target)
            for name in entries:  # renames within one filesystem: nothing is copied
                os.rename(os.path.join(self.folder, name), os.path.join(target, name))
        atomic_write_json(os.path.join(self.folder, STARTED_OVER), launch_record())
        return target

    def release(self) -> None:
        if self.held:
            holder = self._read_holder()
            if holder is None or holder.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            self.held = False

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
