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

Launchers stay real processes (``torch.distributed.run``, Slurm, and the tools that time or measure fresh
processes start their own): a command that is not ``python [-u] SCRIPT|-m MODULE|-c CODE`` is passed to
:mod:`subprocess` unchanged. The server's shim (``SOCKET.python``, standard library only) has the ``python``
commands of the process that runs it forked by the server as well, with the stop signals passed on, and the command
killed with the shim if the shim is killed: torchrun's workers (``PYTHON_EXEC``, the interpreter torchrun starts
them with, is set to it for a torchrun started here) and, with ``CAT_TEST_FORK_CHILDREN=1`` (``sys.executable`` set to
it in the child), the sweeps' submitit cells. A command the server does not fork (submitit's job controller, named by
its own pid; a torchrun) the shim runs as itself. ``CAT_TEST_FORK=0`` sends every command to :mod:`subprocess`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import IO, Any, TextIO

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
    "cat.classification.trainer",
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
# The shim a child with CAT_TEST_FORK_CHILDREN=1 runs as sys.executable (set by serve).
_shim = ""
_TORCHRUN = "torch.distributed.run"
# The signals a child takes as a freshly started interpreter does (SIGPIPE ignored is CPython's start-up setting).
_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGALRM)


def _main_of(argv: list[str]) -> tuple[str, str, list[str], bool] | None:
    """``("path"|"module"|"code", target, arguments, unbuffered)`` of ``[sys.executable, [-u], ...]`` run by the
    child; None: not forkable."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    unbuffered = argv[1] == "-u"
    options = argv[2:] if unbuffered else argv[1:]
    if not options:
        return None
    if options[0] in ("-m", "-c"):
        if len(options) < 2 or options[1] == _TORCHRUN:  # a launcher: a process of its own
            return None
        return ("module" if options[0] == "-m" else "code"), options[1], options[2:], unbuffered
    return None if options[0].startswith("-") else ("path", options[0], options[1:], unbuffered)


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
    kind, target, rest, unbuffered = _main_of(request["argv"])
    if unbuffered:  # python -u
        unbuffered_stream = lambda fd: io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
        sys.stdout, sys.stderr = unbuffered_stream(1), unbuffered_stream(2)
    if os.environ.get("CAT_TEST_FORK_CHILDREN") == "1":  # the Python commands it starts through the server too
        sys.executable = _shim
    # The command's PYTHONPATH before the installed packages, as a fresh interpreter puts it (after the entry 0 set
    # below); the server's own sys.path had none.
    extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[1:1] = [os.path.abspath(entry) for entry in extra]
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
    _end_by_signal(status)
    os._exit(status & 0xFF)


def _end_by_signal(status: int) -> None:
    """For a negative exit status (a command ended by a signal), end this process by that signal too."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)


# --- the server ---------------------------------------------------------------------------------------------------


def serve(address: str) -> None:
    """Import :data:`STACK`, then fork a child per request on the socket at ``address`` until the parent is gone.
    A request is one packet: the JSON ``{argv, cwd, env}`` with the child's stdin, stdout and stderr as file
    descriptors; the answers are ``{"pid": ...}`` and, once it ends, ``{"returncode": ...}``."""
    global _shim
    gc.disable()  # while the stack loads (as the entry scripts do): the collector would walk its objects over and over
    for name in STACK:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # The stack out of the collector's sight: a child's full collections (mmengine's datasets ask for them) walk
    # only what the child made, not the million objects of the imports, whose pages then stay shared.
    gc.collect()
    gc.freeze()
    gc.enable()
    _shim = _shim_of(address)
    with open(_shim, "w") as shim:
        shim.write(f'#!/bin/sh\nexec {shlex.join([sys.executable, "-S", __file__, "--client", address])} "$@"\n')
    os.chmod(_shim, 0o755)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    listener.settimeout(0.05)  # between requests: reap the children that ended
    running: dict[int, socket.socket] = {}
    bound: set[int] = set()  # the children of shims
    print("ready", flush=True)
    while os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            connection, _ = listener.accept()
            connection.settimeout(None)
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:  # the child: never back into this loop
                try:
                    listener.close()
                    for other in running.values():
                        other.close()
                    connection.close()
                    _child(request, fds)
                finally:
                    traceback.print_exc()
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            connection.send(json.dumps({"pid": pid}).encode())
            running[pid] = connection
            if request["bound"]:
                bound.add(pid)
        for pid in list(running):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                bound.discard(pid)
                connection = running.pop(pid)
                # Its CPU time goes to the test that waited for it (tests/cpu_time.py), not to this server's.
                answer = {"returncode": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
                with contextlib.suppress(OSError):
                    connection.send(json.dumps(answer).encode())
                connection.close()
            elif pid in bound and _hung_up(running[pid]):
                os.kill(pid, signal.SIGKILL)  # its shim was killed, as the process the command was would have been
                bound.discard(pid)


def _shim_of(address: str) -> str:
    """The shim of the server at ``address``: a ``python`` whose commands that server forks."""
    return address + ".python"


def _hung_up(connection: socket.socket) -> bool:
    """Whether the client at the other end of ``connection`` is gone (it sends nothing after its request)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


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
# The CPU-seconds of the children this process waited for (with the processes they waited for themselves).
forked_cpu_s = 0.0


def _request(
    connection: socket.socket, argv: list[str], cwd: str, env: Any, fds: list[int], bound: bool = False
) -> int:
    """Ask the server on ``connection`` to fork ``argv`` in ``cwd`` with ``env`` and ``fds`` as its standard
    streams (``bound``: killed if this client is): the child's pid."""
    request = {"argv": argv, "cwd": cwd, "env": dict(env), "bound": bound}
    socket.send_fds(connection, [json.dumps(request).encode()], fds)
    return json.loads(connection.recv(1 << 16))["pid"]


def _started() -> _Server:
    global _server
    if _server is None:
        _server = _Server()
    return _server


def _connect() -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(_started().address)
    return connection


class ForkedProcess:
    """A forked child with :class:`subprocess.Popen`'s ``pid``, ``returncode``, ``stdout``/``stderr`` (pipes
    where asked for), ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(
        self, args: list[str], cwd: Any, env: dict[str, str] | None, stdin: Any, stdout: Any, stderr: Any, text: bool
    ):
        self.args = args
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        with contextlib.ExitStack() as stack:  # the child's ends of its streams: closed here once sent
            fds = [self._fd(stdin, 0, stack, text)]
            for name, stream, default in (("stdout", stdout, 1), ("stderr", stderr, 2)):
                fds.append(fds[1] if stream == subprocess.STDOUT else self._fd(stream, default, stack, text, name))
            self._connection = _connect()
            self.pid = _request(self._connection, list(map(str, args)), str(cwd or os.getcwd()), env or os.environ, fds)

    def _fd(self, stream: Any, default: int, stack: contextlib.ExitStack, text: bool, name: str = "") -> int:
        """The file descriptor the child gets for ``subprocess``'s ``stream`` argument; for a PIPE, its write end
        (the read end becomes this object's ``stdout`` or ``stderr``)."""
        if stream is None:
            return default
        if stream == subprocess.DEVNULL:
            return stack.enter_context(open(os.devnull, "r+b")).fileno()
        if stream == subprocess.PIPE:
            read, write = os.pipe()
            pipe = io.BufferedReader(io.FileIO(read))
            setattr(self, name, io.TextIOWrapper(pipe) if text else pipe)
            return stack.enter_context(open(write, "wb")).fileno()
        return stream if isinstance(stream, int) else stream.fileno()

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

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Its pipes read to their end, each on a thread of its own (a full one would stall the child), then its exit
        status awaited: (stdout, stderr) as :meth:`subprocess.Popen.communicate` gives them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = {name: getattr(self, name) for name in ("stdout", "stderr") if getattr(self, name) is not None}
        read: dict[str, Any] = {}
        readers = [
            threading.Thread(target=lambda name=name, pipe=pipe: read.__setitem__(name, pipe.read()), daemon=True)
            for name, pipe in pipes.items()
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        for pipe in pipes.values():
            pipe.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return read.get("stdout"), read.get("stderr")

    def _finish(self, answer: bytes) -> None:
        """The server's last answer: the exit status, or nothing if the server ended first."""
        self._connection.close()
        if not answer:
            raise RuntimeError(f"the prewarmed interpreter ended while {self.args} ran (pid {self.pid})")
        global forked_cpu_s
        result = json.loads(answer)
        self.returncode = result["returncode"]
        forked_cpu_s += result["cpu_s"]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_tree(self) -> None:
        """Kill it and every process it started (a shim's end makes the server kill what the shim's command is)."""
        from tests.conftest import descendant_pids  # the test process's (conftest imports this module)

        if self.returncode is None:
            for pid in [*descendant_pids(self.pid), self.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# What the forked path takes of subprocess's arguments; a call with any other goes to subprocess.
_POPEN_KEYS = {"cwd", "env", "stdin", "stdout", "stderr", "text"}
_RUN_KEYS = {"cwd", "env", "capture_output", "text", "timeout", "check", "stdout", "stderr"}


def _forks(args: Any, kwargs: dict[str, Any], keys: set[str], pipes: tuple[str, ...]) -> bool:
    """Whether the call runs forked: a Python command, arguments in ``keys``, a PIPE only for the ``pipes``."""
    return (
        os.environ.get("CAT_TEST_FORK", "1") != "0"
        and isinstance(args, list)
        and _main_of(list(map(str, args))) is not None
        and set(kwargs) <= keys
        and not any(kwargs.get(name) == subprocess.PIPE for name in {"stdin", "stdout", "stderr"} - set(pipes))
    )


def python() -> str:
    """A ``python`` whose commands the server forks (the shim), for a tool that starts its own Python processes
    with ``sys.executable``; with ``CAT_TEST_FORK=0``, the interpreter itself."""
    return sys.executable if os.environ.get("CAT_TEST_FORK", "1") == "0" else _shim_of(_started().address)


def _workers_forked(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a torchrun command (``python -m torch.distributed.run``), its workers started through the shim
    (torchrun starts them with ``PYTHON_EXEC``); any other command's unchanged."""
    if not isinstance(args, list) or list(map(str, args[:3])) != [sys.executable, "-m", _TORCHRUN]:
        return kwargs
    return {**kwargs, "env": {"PYTHON_EXEC": python(), **(kwargs.get("env") or os.environ)}}


def Popen(args: Any, **kwargs: Any) -> Any:  # noqa: N802 (subprocess's name)
    """:class:`subprocess.Popen`, a forked child where ``args`` is a Python command this module runs."""
    if not _forks(args, kwargs, _POPEN_KEYS, pipes=("stdout", "stderr")):
        return subprocess.Popen(args, **_workers_forked(args, kwargs))
    streams = (kwargs.get("stdin"), kwargs.get("stdout"), kwargs.get("stderr"))
    return ForkedProcess(args, kwargs.get("cwd"), kwargs.get("env"), *streams, text=bool(kwargs.get("text")))


def run(args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`, a forked child where ``args`` is a Python command this module runs."""
    if not _forks(args, kwargs, _RUN_KEYS, pipes=()):  # its output is captured through files instead
        return subprocess.run(args, **_workers_forked(args, kwargs))
    capture, timeout = kwargs.get("capture_output", False), kwargs.get("timeout")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        streams = (out, err) if capture else (kwargs.get("stdout"), kwargs.get("stderr"))
        child = ForkedProcess(args, kwargs.get("cwd"), kwargs.get("env"), subprocess.DEVNULL, *streams, text=False)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill_tree()
            child.wait()
            raise subprocess.TimeoutExpired(args, timeout, *_read(out, err, capture, kwargs.get("text"))) from None
        captured = _read(out, err, capture, kwargs.get("text"))
    proc = subprocess.CompletedProcess(args, child.returncode, *captured)
    if kwargs.get("check"):
        proc.check_returncode()
    return proc


def _read(out: IO[bytes], err: IO[bytes], capture: bool, text: bool | None) -> list[Any]:
    """What a command wrote to the files its output was captured in: (stdout, stderr), None where not captured."""
    captured = []
    for file in (out, err):
        file.seek(0)
        data = file.read() if capture else None
        captured.append(data.decode(errors="replace") if text and data is not None else data)
    return captured


def _client(address: str, args: list[str]) -> int:
    """The shim's side (``SOCKET.python ARGS``, which ``python ARGS`` becomes for torchrun's workers and in a child
    that sets ``CAT_TEST_FORK_CHILDREN=1``): the command forked by the server on this process's streams, working
    directory and environment, the stop signals passed on to it, its exit status returned; the server kills it if
    this process is killed. Runs without site packages (``-S``): only the standard library is imported, so it
    starts in milliseconds."""
    # submitit's job controller names the job by its own pid; a command the server does not fork: itself.
    if args[:2] == ["-m", "submitit.local._local"] or _main_of([sys.executable, *args]) is None:
        os.execv(sys.executable, [sys.executable, *args])
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(address)
    pid = _request(connection, [sys.executable, *args], os.getcwd(), os.environ, [0, 1, 2], bound=True)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda signum, frame: os.kill(pid, signum))
    answer = connection.recv(1 << 16)
    if not answer:
        print(f"the prewarmed interpreter ended while {args} ran (pid {pid})", file=sys.stderr)
        return 1
    status = json.loads(answer)["returncode"]
    _end_by_signal(status)
    return status


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        sys.exit(_client(sys.argv[2], sys.argv[3:]))
    serve(sys.argv[1])
