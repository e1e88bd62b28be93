"""Atomic file writes: a reader (or a run killed at any moment) sees the old file or the whole new one.

Each write goes to a hidden temporary file in the target's folder (``.NAME.XXXX.tmp``), is flushed
to disk and renamed over the target; :func:`remove_stale_temporaries` clears what a killed writer
left, and is called once a run holds its output folder.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import tempfile
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
]

_TMP_SUFFIX = ".tmp"


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[io.BufferedWriter], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=_TMP_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # an ordinary file's mode (mkstemp makes it private)
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
    """Delete the temporary files killed writers left in ``folder``; returns their paths."""
    stale = [
        entry.path
        for entry in os.scandir(folder)
        if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX) and entry.is_file(follow_symlinks=False)
    ]
    for path in stale:
        os.unlink(path)
    return stale
