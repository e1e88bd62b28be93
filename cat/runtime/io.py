"""Writes in a folder cat owns (a run folder, the packer's output): atomic, and never through what someone planted.

An atomic write goes to a temporary file in the target's folder, created exclusively under an unguessable name
(:func:`temporary_path`: ``.cat-tmp-<16 hex digits>-NAME``), is flushed to disk and renamed over the target; a
reader (or a run killed at any moment) sees the old file or the whole new one. :func:`remove_stale_temporaries`
clears exactly those names, what a killed writer left, once a run holds its folder. Every file cat appends to or
reads back is opened by :func:`open_owned`: a symbolic link, FIFO, folder or device at its name is refused by name
(not followed, never blocked on), and so is one at a name an atomic write replaces; a subfolder cat writes in is
made or checked by :func:`owned_subfolder`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from typing import Any

import torch

from cat.errors import OutputError

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_save",
    "remove_stale_temporaries",
    "temporary_path",
    "is_temporary",
    "open_owned",
    "open_append",
    "read_owned",
    "owned_subfolder",
    "refuse_planted",
]

_TEMPORARY_PREFIX = ".cat-tmp-"
_TEMPORARY_NAME = re.compile(r"\.cat-tmp-[0-9a-f]{16}-.+", re.DOTALL)
_OPEN_FLAGS = {
    "r": os.O_RDONLY,
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def temporary_path(path: str) -> str:
    """A fresh temporary name beside ``path`` (``.cat-tmp-<16 hex digits>-NAME``): what only cat's writers make,
    and so what :func:`remove_stale_temporaries` may delete."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f"{_TEMPORARY_PREFIX}{secrets.token_hex(8)}-{name}")


def is_temporary(name: str) -> bool:
    """Whether ``name`` is one :func:`temporary_path` makes (a write in progress, or a killed writer's)."""
    return _TEMPORARY_NAME.fullmatch(name) is not None


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _planted(path: str, kind: str) -> OutputError:
    return OutputError(
        f"{path} is {kind}, not a regular file: cat writes its files itself and never through or into what is "
        "planted at their names; remove it (nothing was written)"
    )


def open_owned(path: str, mode: str = "r") -> int:
    """A descriptor of ``path``, a regular file, opened to read (``r``), append (``a``, created if absent) or
    create (``x``, exclusively). A symbolic link at the name is not followed and a FIFO never blocks: either, a
    folder or a device is an OutputError naming it, before anything is read or written; so is, for appending, a
    file with another name (a hard link)."""
    flags = _OPEN_FLAGS[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EEXIST) and os.path.lexists(path):
            raise _planted(path, _kind(os.lstat(path).st_mode)) from None
        raise OutputError(f"cannot open {path} ({error.strerror or error})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _planted(path, _kind(info.st_mode))
    if mode == "a" and info.st_nlink > 1:  # a hard link: appending would write into the other name's file too
        os.close(fd)
        raise OutputError(
            f"{path} has {info.st_nlink} names (a hard link): cat appends only to a file of its own; remove it"
        )
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def open_append(path: str) -> io.TextIOWrapper:
    """``path`` opened to append text (:func:`open_owned`); a character the text cannot encode is written escaped,
    so appending never raises on what a run logs (a file name that is not UTF-8)."""
    return open(open_owned(path, "a"), "a", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115


def read_owned(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, a regular file (:func:`open_owned`)."""
    with open(open_owned(path), "rb") as f:
        return f.read(limit)


def refuse_planted(path: str) -> None:
    """An OutputError where something other than a regular file stands at ``path`` (a name cat is about to
    replace or write): a symbolic link, FIFO, folder or device."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _planted(path, _kind(mode))


def owned_subfolder(path: str) -> str:
    """``path``, a folder cat writes in (``profile/``, ``eval/``): made if absent, refused (OutputError) if a
    symbolic link, or anything but a folder, stands there. Returns ``path``."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise OutputError(
            f"{path} is {_kind(mode)}, not a folder: cat writes in folders it made, never through a link; remove it"
        )
    return path


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[io.BufferedWriter], object]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    refuse_planted(path)
    tmp = temporary_path(path)
    fd = open_owned(tmp, "x")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        # Measured before the partial file goes: torch's zip writer reports a full disk as a
        # RuntimeError ("unexpected pos ..."), so the free space tells it apart from a bug.
        full = isinstance(error, (OSError, RuntimeError)) and _disk_full(error, folder)
        if os.path.exists(tmp):
            os.unlink(tmp)
        if full:
            raise OutputError(
                f"cannot write {path}: no space left on the device holding {folder}; "
                f"{'the previous file is unchanged' if os.path.exists(path) else 'nothing was written'}: "
                "free some space and rerun the same command to resume"
            ) from None
        raise
    _fsync_dir(folder)


def _disk_full(error: BaseException, folder: str) -> bool:
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def atomic_write_bytes(path: str, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str, payload: dict[str, Any]) -> None:
    """Strict JSON (``NaN``/``Infinity`` are refused: they are not JSON), written atomically."""
    atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=False) + "\n")


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))


def remove_stale_temporaries(folder: str) -> list[str]:
    """Delete the temporary files killed writers left in ``folder``: regular files named exactly as
    :func:`temporary_path` names them, nothing else; returns their paths."""
    stale = [
        entry.path for entry in os.scandir(folder) if is_temporary(entry.name) and entry.is_file(follow_symlinks=False)
    ]
    for path in stale:
        os.unlink(path)
    return stale
