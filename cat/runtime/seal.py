"""Seals on the caches cat keeps in run folders (a dataset's index, a shard scan): only the user who wrote one can
make a seal that holds.

A cache's own checksum says it is whole, not whose it is: anyone who can write into a run folder (a shared,
group-writable project folder) could rewrite an index, recompute its checksum, and have a run train on labels or
counts of their choosing. A seal is an HMAC-SHA256 of the cache's content under a key that is the user's alone:
32 random bytes in ``$XDG_CACHE_HOME/cat/seal.key`` (``~/.cache`` by default; ``CAT_SEAL_KEY_FILE`` names another
file), made on first use, mode 0600, owned by the user. A cache whose seal does not hold is rebuilt from the data,
never believed. Where no key file can be made (a read-only home), this process's own key is used, so the caches it
writes are rebuilt by the next process: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from functools import cache
from typing import Any

from cat.errors import OutputError
from cat.runtime.logger import DATA_LOGGER

__all__ = ["seal", "seal_holds", "key_file"]

_KEY_BYTES = 32
log = logging.getLogger(DATA_LOGGER)


def key_file() -> str:
    """Where this user's seal key is kept."""
    named = os.environ.get("CAT_SEAL_KEY_FILE")
    if named:
        return named
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cat", "seal.key")


def _read_key(path: str) -> bytes:
    """The key at ``path``, refused unless it is a regular file of the user's own that no one else can read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        key = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    problem = (
        "not a regular file"
        if not stat.S_ISREG(info.st_mode)
        else f"owned by uid {info.st_uid}, not this user ({os.geteuid()})"
        if info.st_uid != os.geteuid()
        else f"readable by others (mode {stat.S_IMODE(info.st_mode):o})"
        if info.st_mode & 0o077
        else f"{len(key)} bytes, not {_KEY_BYTES}"
        if len(key) != _KEY_BYTES
        else None
    )
    if problem is not None:
        raise OutputError(f"cat's seal key {path} is {problem}: delete it (cat makes a new one)")
    return key


def _new_key(path: str) -> bytes:
    """Make the key file: written whole under a private name, then linked to ``path`` (a process that loses the
    race reads the winner's)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    draft = os.path.join(folder, f".seal.key.{secrets.token_hex(8)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as file:
            file.write(secrets.token_bytes(_KEY_BYTES))
            file.flush()
            os.fsync(file.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
    finally:
        os.unlink(draft)
    return _read_key(path)


@cache
def _key() -> bytes:
    path = key_file()
    try:
        try:
            return _read_key(path)
        except FileNotFoundError:
            return _new_key(path)
    except OSError as error:
        log.warning(
            "no seal key at %s (%s): this process seals its caches with a key of its own (the next run rebuilds them)",
            path,
            error.strerror or error,
        )
        return secrets.token_bytes(_KEY_BYTES)


def seal(content: Any) -> str:
    """The seal of ``content`` (anything JSON holds) under this user's key."""
    payload = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hmac.new(_key(), payload, hashlib.sha256).hexdigest()


def seal_holds(content: Any, claimed: object) -> bool:
    """Whether ``claimed`` is this user's seal of ``content``."""
    try:
        expected = seal(content)
    except (TypeError, ValueError, RecursionError):  # content no cat cache holds
        return False
    return isinstance(claimed, str) and hmac.compare_digest(expected, claimed)
