"""``python SCRIPT ARGS`` (or ``python -m MODULE``, ``python -c CODE``) as a real process of its own, forked from
an interpreter that has already imported torch, timm, the OpenMMLab stack and cat.

A fresh interpreter spends ~8 s of CPU importing torch, torchvision and timm (~12 s with mmdet/mmseg) before a toy
run's first step, and the end-to-end tests start hundreds of them: most of the suite's time. The server here
imports the stack once per pytest worker and forks one child per command. The child is a process of its own (its
own pid, signals, exit status, file descriptors, DataLoader workers below it) set up as ``subprocess`` would start
it: the command's working directory, environment, standard streams and thread count, fresh random seeds, Python's
default signal dispositions, and its exit status as the interpreter would give it (``sys.exit``, an uncaught
exception, an uncaught KeyboardInterrupt). What it skips is the imports. The one difference a command can see is
what they register: cat's models in timm's registry, cat's safe globals in torch's, the OpenMMLab registries
filled. A test of what a fresh interpreter has (a plain script not seeing cat's models, torch refusing an mmengine
checkpoint without cat's allow-list) uses :mod:`subprocess` itself. (The stack reads no environment variable at
import that a test sets.)

Launchers stay real processes (``torch.distributed.run``, Slurm, Hydra's launchers start their own): a command
that is not ``python SCRIPT|-m MODULE|-c CODE`` is passed to :mod:`subprocess` unchanged. ``CAT_TEST_FORK=0``
sends every command there.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
# What the entry points and tools import on their way to a step; a module missing here (no OpenMMLab stack) is
# skipped and the child imports what it needs itself.
STACK = (
    "torch",
    "torchvision",
    "timm",
    "wandb",
    "hydra",
    "cat.classification.job",
    "cat.classification.builders",
    "cat.toolkit",
    "mmengine.runner",
    "mmdet.models",
    "mmdet.datasets",
    "mmdet.engine",
    "mmdet.evaluation",
    "mmdet.visualization",
    "mmseg.models",
    "mmseg.datasets",
    "mmseg.engine",
    "mmseg.evaluation",
    "mmseg.visualization",
    "pycocotools.coco",
    "cat.mm.runner",
    "cat.mm.det",
    "cat.mm.seg",
)
# The signals a child takes as a freshly started interpreter does (SIGPIPE ignored is CPython's start-up setting).
_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGALRM)


def _main_of(argv: list[str]) -> tuple[str, str] | None:
    """``("path"|"module"|"code", target)`` of ``[sys.executable, ...]`` run by the child; None: not forkable."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] in ("-m", "-c"):
        if len(argv) < 3 or argv[2] == "torch.distributed.run":  # torchrun starts its own workers
            return None
        return ("module" if argv[1] == "-m" else "code"), argv[2]
    return None if argv[1].startswith("-") else ("path", argv[1])


# --- the child ----------------------------------------------------------------------------------------------------


def exit_status(code: object, stderr: TextIO) -> int:
    """The interpreter's exit status for ``SystemExit(code)``, a message printed to ``stderr``."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=stderr)  # what the interpreter does with sys.exit("message")
    return 1


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """Set up as ``subprocess`` would have started ``request['argv']``, run it, and leave with its exit status."""
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in _DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    kind, target = _main_of(request["argv"])
    rest = request["argv"][3:] if kind != "path" else request["argv"][2:]
    status = 0
    try:
        if kind == "path":
            sys.argv = [target, *rest]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.argv = [target, *rest]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as exit_:
        status = exit_status(exit_.code, sys.stderr)
    except KeyboardInterrupt:  # the interpreter prints it, then ends by SIGINT (status -2 to its parent)
        traceback.print_exc()
        status = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        status = 1
    _leave(status)


def _leave(status: int) -> None:
    """What the interpreter does on its way out: join threads, run atexit handlers, flush, exit."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


# --- the server ---------------------------------------------------------------------------------------------------


def serve(address: str) -> None:
    """Import :data:`STACK`, then fork a child per request on the socket at ``address`` until the parent is gone.
    A request is one packet: the JSON ``{argv, cwd, env}`` with the child's stdin, stdout and stderr as file
    descriptors; the answers are ``{"pid": ...}`` and, once it ends, ``{"returncode": ...}``."""
    for name in STACK:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    listener.settimeout(0.05)  # between requests: reap the children that ended
    running: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            connection, _ = listener.accept()
            connection.settimeout(None)
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:  # the child: never back into this loop
                try:
                    listener.close()
                    for other in running.values():
                        other.close()
                    connection.close()
                    _child(json.loads(message), fds)
                finally:
                    traceback.print_exc()
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            connection.send(json.dumps({"pid": pid}).encode())
            running[pid] = connection
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = running.pop(pid)
                with contextlib.suppress(OSError):
                    connection.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                connection.close()


# --- the client ---------------------------------------------------------------------------------------------------


class _Server:
    """This process's server, started on first use, ended with this process."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="cat-prewarmed-")
        self.address = os.path.join(self._folder.name, "socket")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.prewarmed", self.address],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self._process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the prewarmed interpreter did not start (exit status {self._process.wait()})")
        atexit.register(self.close)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._folder.cleanup()


_server: _Server | None = None


def _connect() -> socket.socket:
    global _server
    if _server is None:
        _server = _Server()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(_server.address)
    return connection


def _fd(stream: Any, default: int, stack: contextlib.ExitStack) -> int:
    """The file descriptor a child's stream gets for ``subprocess``'s ``stream`` argument."""
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return stack.enter_context(open(os.devnull, "r+b")).fileno()
    return stream if isinstance(stream, int) else stream.fileno()


class ForkedProcess:
    """A forked child with :class:`subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, args: list[str], cwd: Any, env: dict[str, str] | None, stdin: Any, stdout: Any, stderr: Any):
        self.args = args
        self.returncode: int | None = None
        with contextlib.ExitStack() as stack:
            fds = [_fd(stdin, 0, stack), _fd(stdout, 1, stack), _fd(stderr, 2, stack)]
            request = {"argv": list(map(str, args)), "cwd": str(cwd or os.getcwd()), "env": dict(env or os.environ)}
            self._connection = _connect()
            socket.send_fds(self._connection, [json.dumps(request).encode()], fds)
        self.pid = json.loads(self._connection.recv(1 << 16))["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._connection.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._finish(self._connection.recv(1 << 16))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                self._finish(self._connection.recv(1 << 16))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _finish(self, answer: bytes) -> None:
        """The server's last answer: the exit status, or nothing if the server ended first."""
        self._connection.close()
        if not answer:
            raise RuntimeError(f"the prewarmed interpreter ended while {self.args} ran (pid {self.pid})")
        self.returncode = json.loads(answer)["returncode"]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# What the forked path takes of subprocess's arguments; a call with any other goes to subprocess.
_POPEN_KEYS = {"cwd", "env", "stdin", "stdout", "stderr"}
_RUN_KEYS = {"cwd", "env", "capture_output", "text", "timeout", "check", "stdout", "stderr"}


def _forks(args: Any, kwargs: dict[str, Any], keys: set[str]) -> bool:
    return (
        os.environ.get("CAT_TEST_FORK", "1") != "0"
        and isinstance(args, list)
        and _main_of(list(map(str, args))) is not None
        and set(kwargs) <= keys
        and subprocess.PIPE not in (kwargs.get("stdin"), kwargs.get("stdout"), kwargs.get("stderr"))
    )


def Popen(args: Any, **kwargs: Any) -> Any:  # noqa: N802 (subprocess's name)
    """:class:`subprocess.Popen`, a forked child where ``args`` is a Python command this module runs."""
    if not _forks(args, kwargs, _POPEN_KEYS):
        return subprocess.Popen(args, **kwargs)
    streams = (kwargs.get("stdin"), kwargs.get("stdout"), kwargs.get("stderr"))
    return ForkedProcess(args, kwargs.get("cwd"), kwargs.get("env"), *streams)


def run(args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`, a forked child where ``args`` is a Python command this module runs."""
    if not _forks(args, kwargs, _RUN_KEYS):
        return subprocess.run(args, **kwargs)
    capture, timeout = kwargs.get("capture_output", False), kwargs.get("timeout")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        streams = (out, err) if capture else (kwargs.get("stdout"), kwargs.get("stderr"))
        child = ForkedProcess(args, kwargs.get("cwd"), kwargs.get("env"), subprocess.DEVNULL, *streams)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        captured = []
        for file in (out, err):
            file.seek(0)
            data = file.read() if capture else None
            captured.append(data.decode(errors="replace") if kwargs.get("text") and data is not None else data)
    proc = subprocess.CompletedProcess(args, child.returncode, *captured)
    if kwargs.get("check"):
        proc.check_returncode()
    return proc


if __name__ == "__main__":
    serve(sys.argv[1])
