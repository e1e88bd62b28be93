"""Which folders a run may touch: a run folder owned by the run that made it (its marker), checked writable, held
exclusively (its lock), cleaned of killed writers' leftovers.

A run folder is known by the marker (``.cat-run``) the run writes when it makes the folder (or takes a new or empty
one): its identity (host, pid, user, time, launch). Only such a folder is locked, cleaned or started over
(:func:`run_folder_problem`); any other folder that holds anything is refused before a file in it is touched, and so
are the folders no run may own (:func:`output_dir_problems`: ``/``, ``$HOME``, the checkout, the current directory,
a folder of runs, the data). A folder a run made before markers existed is recognised by what such a run left
(``config.yaml`` with a cat job's keys, beside its log, metrics or checkpoint) and marked when a run takes it.

Only one live run may write a folder. The holder is recorded in ``.lock`` (host, pid, process start
time, Slurm job id); a second run fails at once naming the holder. A lock left by a run that died
(SIGKILL, node crash) is taken over when its process is gone from this host, or when it belongs to
an earlier incarnation of the same Slurm job (a requeued job).

A run records what it makes in the folder's top level (``.cat-made``) as it writes: its log and config, each
checkpoint, at its end. Starting the folder over (``resume=false``) moves exactly those names into
``earlier_runs/<time>/``; anything else there (a user's pretrained weights, notes, a dataset copy) stays, and the log
names it.

A run that starts the folder over records which launch did (``.started_over``): the
Slurm job and its restart count, torchrun's run and its restart count. A later start of that launch (the
job requeued, torchrun restarting its workers) goes on with the run instead of starting it over again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import yaml

from cat.errors import OutputError, RunDirLockedError

from .io import atomic_write_json, is_temporary, read_owned, refuse_planted, remove_stale_temporaries

__all__ = [
    "RunDirLock",
    "check_writable",
    "is_run_folder",
    "run_folder_problem",
    "output_dir_problems",
    "RUN_MARKER",
    "LOCK_NAME",
    "EARLIER_RUNS",
    "MADE_RECORD",
    "made_here",
    "recorded_made",
    "STARTED_OVER",
    "launch_record",
    "read_started_over",
    "relaunch_of",
]

LOCK_NAME = ".lock"
RUN_MARKER = ".cat-run"  # written by the run that makes (or takes a new, empty) folder: the folder is a cat run's
EARLIER_RUNS = "earlier_runs"  # where a run started over with resume=false keeps the folder's earlier run
MADE_RECORD = ".cat-made"  # the names runs made in the folder's top level: what starting over moves aside
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


class _NotJSON(ValueError):
    """A record's text that is no JSON value (``text``: the text read)."""

    def __init__(self, path: str, text: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.text = text


def _json_head(path: str) -> tuple[str, Any]:
    """The first 4 KiB of a small JSON record cat keeps in a run folder, and its value (_NotJSON, a ValueError, if it
    is none, nesting too deep for the parser included; OutputError if a link, FIFO or folder stands at its name)."""
    text = read_owned(path, 4096).decode("utf-8", errors="replace")
    try:
        return text, json.loads(text)
    except ValueError as error:
        raise _NotJSON(path, text, str(error)) from None
    except RecursionError:  # '[[[[...': no record of cat's nests deeper than two
        raise _NotJSON(path, text, "nested too deeply to be a record of cat's") from None


# What a run made before markers existed leaves beside its config.yaml: a log, metrics, a checkpoint.
_EARLIER_RUN_FILES = ("log.txt", "metrics.jsonl", "metrics.json", "last.pth", "last_checkpoint")
_JOB_KEYS = frozenset({"mode", "output_dir", "seed", "resume", "model"})  # in every cat job's config.yaml
_MODE_FOLDERS = ("eval", "throughput")  # where a run folder's other modes write (cat.runtime.folder.run_dir_for)


def _marked(folder: str) -> bool:
    """Whether ``folder`` holds cat's run marker (a symbolic link or FIFO there is an OutputError naming it)."""
    path = os.path.join(folder, RUN_MARKER)
    if not os.path.lexists(path):
        return False
    try:
        record = _json_head(path)[1]
    except ValueError:
        record = None
    if not (isinstance(record, dict) and record.get("cat_run") == 1):
        raise OutputError(f"{path} is not cat's run marker; remove it if {folder} is not a cat run's folder")
    owner = os.lstat(path).st_uid
    if owner != os.getuid() or record.get("uid", owner) != owner:
        raise OutputError(
            f"{folder} is another user's run folder (its marker {RUN_MARKER} belongs to uid {owner}, recorded "
            f"{record.get('uid')!r}; you are uid {os.getuid()}): choose a folder of your own"
        )
    return True


def _made_before_markers(folder: str, within_mode_folder: bool = False) -> bool:
    """Whether ``folder`` is a run folder from before markers: a ``config.yaml`` with a cat job's keys beside what
    such a run leaves, or a folder holding nothing but runs of other modes (an ``eval/``), which hold no further
    mode folders of their own (``eval/eval/...`` 400 deep ran out of stack)."""
    config = os.path.join(folder, "config.yaml")
    with contextlib.suppress(OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, OutputError):
        if os.path.isfile(config) and any(os.path.lexists(os.path.join(folder, n)) for n in _EARLIER_RUN_FILES):
            recorded = yaml.safe_load(read_owned(config, 1 << 20).decode("utf-8"))
            return isinstance(recorded, dict) and recorded.keys() >= _JOB_KEYS
    if within_mode_folder:
        return False
    entries = os.listdir(folder)
    return bool(entries) and all(
        name in _MODE_FOLDERS
        and os.path.isdir(path := os.path.join(folder, name))
        and (_marked(path) or _made_before_markers(path, within_mode_folder=True))
        for name in entries
    )


def is_run_folder(folder: str) -> bool:
    """Whether ``folder`` is a cat run's: it holds the run marker, or was made by a run before markers."""
    return os.path.isdir(folder) and (_marked(folder) or _made_before_markers(folder))


def _entries(folder: str, key: str = "output_dir") -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except NotADirectoryError:
        raise OutputError(f"{key}={folder} is a file, not a folder") from None


def run_folder_problem(folder: str, key: str = "output_dir") -> str | None:
    """None where a run may take ``folder``: new, empty, or a cat run's (:func:`is_run_folder`); else the one
    line that refuses it. Nothing in a folder that is not a run's is moved, deleted, locked or written."""
    if not os.path.exists(folder):
        return None
    try:
        entries = _entries(folder, key)
        if not entries or is_run_folder(folder):
            return None
    except OSError as error:
        return f"{key}={folder}: cannot be read ({error.strerror or error})"
    except OutputError as error:
        return str(error)
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    return (
        f"{key}={folder} holds files that are not a cat run's ({len(entries)} "
        f"{'entry' if len(entries) == 1 else 'entries'}, e.g. {shown}); "
        "choose an empty or new folder"
    )


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def output_dir_problems(output_dir: str, data_roots: Iterable[str | None] = (), mode_dir: str = "") -> list[str]:
    """What forbids ``output_dir`` as a run's folder, one line each: empty, ``/``, ``$HOME``, the checkout or a
    folder holding either, the current directory or a folder of runs where it is no run's own, a folder inside a
    dataset (``data_roots``), one that is not a run's (:func:`run_folder_problem`), or one that cannot be written.
    ``mode_dir``: the folder the run writes in, where it is not ``output_dir`` (``eval/``), checked as one too."""
    if not output_dir.strip():
        return [
            "output_dir is empty (an unset shell variable?): give the run a folder, e.g. output_dir=outputs/cls/my_run"
        ]
    try:  # realpath reads each link on the way: /proc/1/cwd is one that only its owner may read
        real = os.path.realpath(output_dir)
        roots = [(root, os.path.realpath(root)) for root in filter(None, data_roots)]
    except OSError as error:
        where = f"{error.strerror}: {error.filename}"
        return [f"output_dir={output_dir} or a data path: cannot follow a link on its path ({where})"]
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    for place, what in (
        (os.path.realpath(os.path.expanduser("~")), "your home folder"),
        (checkout, "the cat checkout"),
        (os.sep, "the filesystem's root"),
    ):
        if _is_within(place, real):
            held = "is" if place == real else "holds"
            return [
                f"output_dir={output_dir} {held} {what} ({place}), not a run's folder: give the run a folder of its own"
            ]
    for root, real_root in roots:
        if _is_within(real, real_root):
            return [f"output_dir={output_dir} is inside data.root={root}: a run never writes into its dataset"]
        if _is_within(real_root, real):
            return [
                f"data.root={root} is inside output_dir={output_dir}: a run folder holds what runs write, which "
                "resume=false moves aside; keep the dataset outside it"
            ]
    try:
        foreign = os.path.isdir(real) and not is_run_folder(real)
    except OutputError as error:  # a marker that is not cat's, or another user's
        return [str(error)]
    if foreign:
        if real == os.path.realpath(os.getcwd()):
            return [f"output_dir={output_dir} is the current directory, not a cat run's folder: give the run its own"]
        with contextlib.suppress(OSError, OutputError):
            runs = [name for name in _entries(real)[:1000] if _child_run(os.path.join(real, name))]
            if runs:
                return [
                    f"output_dir={output_dir} holds other runs' folders ({', '.join(runs[:3])}): give this run a "
                    f"folder of its own, e.g. output_dir={os.path.join(output_dir, 'my_run')}"
                ]
    for folder in (output_dir, *([mode_dir] if mode_dir and mode_dir != output_dir else [])):
        if (problem := run_folder_problem(folder)) is not None:
            return [problem]
    problem = check_writable(output_dir)
    return [problem] if problem is not None else []


# The files a run keeps in its folder's top level (besides checkpoints and its own bookkeeping): a folder at one
# of these names is refused with the planted links and FIFOs, before the run starts rather than at its first write.
RUN_FILES = (
    "log.txt",
    "metrics.jsonl",
    "metrics.json",
    "config.yaml",
    "overrides.yaml",
    "config_changes.jsonl",
    "wandb_run_id.txt",
    "last.pth",
    "best.pth",
    LOCK_NAME,
    STARTED_OVER,
    RUN_MARKER,
    MADE_RECORD,
)


# The folders a run keeps there: a file at one of these names is refused with the rest, before the run writes in it.
RUN_FOLDERS = ("eval", "throughput", "profile", "wandb", EARLIER_RUNS)


def refuse_planted_entries(folder: str) -> None:
    """An OutputError naming the first entry of a run folder that no run writes there: a symbolic link, FIFO,
    socket or device (cat makes none of them), a folder at the name of one of :data:`RUN_FILES` or of a
    checkpoint (``*.pth``), or a file at one of :data:`RUN_FOLDERS`. Checked as a run takes its folder, so a
    planted name ends it in one line before anything is written through it."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISREG(mode) and entry.name in RUN_FOLDERS:
            raise OutputError(f"{entry.path} is a file where a run keeps a folder; remove it (nothing was written)")
        a_file_name = entry.name in RUN_FILES or entry.name.endswith(".pth")
        if stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and not a_file_name):
            continue
        refuse_planted(entry.path)


_BOOKKEEPING = frozenset({LOCK_NAME, RUN_MARKER, MADE_RECORD, STARTED_OVER, EARLIER_RUNS})
# A folder marked before runs recorded what they made: cat's own fixed names, and the checkpoints and folders that
# cat's trainer and mmengine name by number, are taken as its runs' (nothing else there is moved).
_MADE_BEFORE_RECORDS = re.compile(
    r"epoch_\d+\.pth|iter_\d+\.pth|best_[\w.-]+\.pth|mm_config\.py|last_checkpoint|\d{8}_\d{6}", re.ASCII
)


def recorded_made(folder: str) -> set[str] | None:
    """The top-level names the runs in ``folder`` recorded making (:data:`MADE_RECORD`); None where the folder has
    no record (a folder from before records, or no run's). A file there that is not cat's record is refused."""
    path = os.path.join(folder, MADE_RECORD)
    if not os.path.lexists(path):
        return None
    try:
        record = json.loads(read_owned(path, 1 << 22).decode("utf-8"))
    except (ValueError, RecursionError, OutputError):
        record = None
    names = record.get("names") if isinstance(record, dict) and record.get("cat_made") == 1 else None
    if not (isinstance(names, list) and all(isinstance(n, str) and n and os.sep not in n for n in names)):
        raise OutputError(
            f"{path} is not cat's record of what runs made in {folder}; remove it if {folder} is not a cat run's "
            "folder (starting it over then moves nothing)"
        )
    return set(names)


def made_here(folder: str) -> set[str]:
    """The top-level names of ``folder`` that its runs made: those they recorded, the folders of a run's other modes
    (``eval/``: each a run's by its own marker), and, in a folder from before records, cat's own names."""
    entries = set(os.listdir(folder)) - _BOOKKEEPING
    recorded = recorded_made(folder)
    if recorded is None:
        recorded = {n for n in entries if n in RUN_FILES or n in RUN_FOLDERS or _MADE_BEFORE_RECORDS.fullmatch(n)}
    modes = {n for n in entries if n in _MODE_FOLDERS and _child_run(os.path.join(folder, n))}
    return (recorded & entries) | modes


def _child_run(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and is_run_folder(path)


def read_started_over(folder: str) -> dict[str, Any] | None:
    """The launch that started ``folder``'s run over, from its ``.started_over`` record; None where it has none.
    A file there that is not cat's record is refused by name."""
    path = os.path.join(folder, STARTED_OVER)
    if not os.path.lexists(path):
        return None
    try:
        record = _json_head(path)[1]
    except (OSError, ValueError, OutputError):  # a link, FIFO or folder, unreadable, no JSON
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


# The audit events by which this process makes a name: the path each names, by its position among the arguments.
_MAKING_EVENTS = {"os.mkdir": 0, "os.rename": 1, "os.symlink": 1, "os.link": 1, "os.mkfifo": 0, "os.mknod": 0}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class _WritesWatched:
    """The top-level names this process writes in the folders it watches, seen through Python's audit hook (every
    ``open`` for writing, ``mkdir``, rename, link): what the run's own writers and mmengine's make, and never a file
    another process (a user's editor, a copy) puts there. A file a library writes from C++ alone (torch.save's zip
    writer) is seen by the rename that finishes cat's atomic write, or by the folder made for it."""

    def __init__(self) -> None:
        self.folders: dict[str, set[str]] = {}
        self.installed = False

    def watch(self, folder: str) -> None:
        self.folders.setdefault(os.path.realpath(folder), set())
        if not self.installed:
            sys.addaudithook(self._event)  # for the process's life: an audit hook cannot be removed
            self.installed = True

    def forget(self, folder: str) -> None:
        self.folders.pop(os.path.realpath(folder), None)

    def written(self, folder: str) -> set[str]:
        return self.folders.get(os.path.realpath(folder), set())

    def _event(self, event: str, args: tuple) -> None:
        if not self.folders:
            return
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & _WRITE_FLAGS)
            if not writes:
                return
        elif event in _MAKING_EVENTS:
            path = args[_MAKING_EVENTS[event]]
        else:
            return
        if isinstance(path, (str, bytes)):
            self._note(os.fsdecode(path))

    def _note(self, path: str) -> None:
        parent, name = os.path.split(os.path.abspath(path))
        real = os.path.join(os.path.realpath(parent), name)
        for folder, names in self.folders.items():
            if real.startswith(folder + os.sep):
                names.add(real[len(folder) + 1 :].split(os.sep, 1)[0])


_WATCHED = _WritesWatched()


class RunDirLock:
    """Exclusive hold on ``folder`` for one run; ``with RunDirLock(folder):`` or acquire()/release()."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.held = False
        self.recorded: set[str] | None = None  # the names in the folder's record of what its runs made, once read
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
        except OSError:
            return None
        except _NotJSON as error:
            if error.text.lstrip()[:1] in ("", "{"):  # cat's record, not yet all written
                return None
            text, holder = error.text, None
        pid = holder.get("pid") if isinstance(holder, dict) else None
        if not (type(pid) is int and 0 < pid < 2**31 and isinstance(holder.get("host"), str)):
            raise RunDirLockedError(
                f"{self.path} holds {text[:80]!r}, not cat's lock record (host, pid); remove it if no run is "
                f"using {self.folder}"
            )
        return holder

    def acquire(self) -> RunDirLock:
        """Take the folder: refused (OutputError) unless it is new, empty or a cat run's (:func:`run_folder_problem`);
        marked as this run's where it has no marker yet; cleaned of what killed writers left."""
        if (problem := run_folder_problem(self.folder)) is not None:
            raise OutputError(problem)
        os.makedirs(self.folder, exist_ok=True)
        refuse_planted_entries(self.folder)
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
            try:
                self._mark()
                recorded_made(self.folder)  # read before anything is written: a record that is not cat's is refused
            except BaseException:  # a record that is not cat's: the folder is left as it was, unlocked
                os.unlink(self.path)
                raise
            self.held = True
            _WATCHED.watch(self.folder)
            self.notes += [
                f"removed {path}, left by a writer that was killed" for path in remove_stale_temporaries(self.folder)
            ]
            return self
        raise RunDirLockedError(f"could not take the lock {self.path}: other runs keep racing for it")

    def _mark(self) -> None:
        """Write the run marker where the folder has none: a new or empty folder, or one a run made before markers."""
        if _marked(self.folder):
            return
        if set(os.listdir(self.folder)) - {LOCK_NAME}:
            self.notes.append(
                f"{self.folder}: a run folder from before run markers; marked as a cat run's ({RUN_MARKER})"
            )
        record = {k: v for k, v in self._record().items() if k != "since"}
        atomic_write_json(
            os.path.join(self.folder, RUN_MARKER),
            {"cat_run": 1, "made": time.strftime("%Y-%m-%d %H:%M:%S"), "uid": os.getuid(), **record, **launch_record()},
        )

    def record_made(self) -> None:
        """Add what this process wrote in the held folder's top level (:class:`_WritesWatched`) to the folder's
        record of what its runs made (:data:`MADE_RECORD`): starting over moves those names and nothing else; a file
        someone else put there meanwhile is not the run's. Called as the run writes (its log and config, each
        checkpoint, at its end); a run killed in between leaves names unrecorded, which a start over then leaves in
        place and names in the log."""
        if not self.held:
            return
        entries = set(os.listdir(self.folder)) - _BOOKKEEPING
        if self.recorded is None:
            self.recorded = made_here(self.folder)
        written = {name for name in _WATCHED.written(self.folder) if not is_temporary(name)}
        now = (self.recorded | written) & entries
        if now != self.recorded or not os.path.lexists(os.path.join(self.folder, MADE_RECORD)):
            atomic_write_json(os.path.join(self.folder, MADE_RECORD), {"cat_made": 1, "names": sorted(now)})
            self.recorded = now

    def set_aside_earlier_run(self) -> str | None:
        """Start the held folder over (``resume=false``): move what its runs recorded making (:func:`made_here`)
        into ``earlier_runs/<time>/`` with that record, so their record and checkpoints are kept and none of them
        mixes with the new run's (a snapshot, a metric history, a W&B run id), and record this launch as the one
        that started it over. Anything else in the folder (a user's file or folder) stays where it is, and the log
        names it. Returns where the earlier run went, None if the folder held none."""
        assert self.held, "set_aside_earlier_run needs the lock"
        entries = sorted(made_here(self.folder))
        # The launch record is the start over's own bookkeeping: replaced below, not kept.
        if left := sorted(set(os.listdir(self.folder)) - _BOOKKEEPING - set(entries)):
            shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
            self.notes.append(f"resume=false left in {self.folder} what no run recorded making there: {shown}")
        target = None
        if entries:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            target = os.path.join(self.folder, EARLIER_RUNS, stamp)
            for n in range(1, 1000):  # two starts over within one second
                if not os.path.exists(target):
                    break
                target = os.path.join(self.folder, EARLIER_RUNS, f"{stamp}-{n}")
            os.makedirs(target)
            for name in [*entries, *[MADE_RECORD] * os.path.lexists(os.path.join(self.folder, MADE_RECORD))]:
                os.rename(os.path.join(self.folder, name), os.path.join(target, name))  # one filesystem: no copy
        self.recorded = None
        atomic_write_json(os.path.join(self.folder, MADE_RECORD), {"cat_made": 1, "names": []})  # made from here
        atomic_write_json(os.path.join(self.folder, STARTED_OVER), launch_record())
        return target

    def release(self) -> None:
        if self.held:
            self.record_made()
            _WATCHED.forget(self.folder)
            holder = self._read_holder()
            if holder is None or holder.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            self.held = False

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
