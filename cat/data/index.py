"""A split's per-image bookkeeping as a handful of numpy arrays, built once per node and mapped by everyone else.

At ImageNet scale (1.28 M images, 8 ranks x 8 loader workers on a node) a Python object per image costs tens of
gigabytes: every rank lists the images again, and every forked worker copies the pages the objects' reference
counts dirty. A :class:`SampleIndex` holds numbers in arrays (labels, and what a format needs: a zip member's
offsets, sizes and CRC) and names in one byte buffer with offsets. Nothing writes those pages, so forked workers
share them; and :func:`shared_index` keeps one copy per node in a file in the run's folder: the first of the
node's ranks to ask builds it (or finds a valid one) and writes it atomically while the others wait on a lock
beside it, then all map it read-only, so its pages are the page cache's, held once.

The file: ``CATINDEX``, a little-endian u32 version and u32 header length, a JSON header (kind, the key of what
was indexed, small facts such as class names, each array's dtype, length and offset, the body's sha256, and the
header's seal under the user's key, :mod:`cat.runtime.seal`), then the arrays at 64-byte-aligned offsets. It is
read as untrusted input: the seal must hold (an index rewritten by anyone else, checksum recomputed or not, is not
believed), every length, offset and dtype is checked against the file and the kind's declared arrays, the body
against its checksum, the key against the dataset as it is now; anything off is rebuilt, with a log line saying
why. Each reader then checks what its arrays mean (labels
within the classes, a name inside its folder, a member inside its zip), exactly as it checks a fresh index.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import io
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cat.errors import OutputError
from cat.runtime.io import atomic_write, open_owned
from cat.runtime.logger import DATA_LOGGER
from cat.runtime.seal import seal, seal_holds

__all__ = [
    "SampleIndex",
    "IndexSamples",
    "pack_names",
    "shared_index",
    "index_path",
    "load_index",
    "save_index",
    "return_freed_memory",
]

MAGIC = b"CATINDEX"
VERSION = 1
_PREAMBLE = struct.Struct("<8sII")
_ALIGN = 64
_MAX_HEADER_BYTES = 16 << 20  # a header of more (a million class names?) is not one cat wrote
_MAX_INDEX_BYTES = 16 << 30  # ImageNet's is about 60 MB: a file of more is not one cat wrote
# What every index holds, and what each kind adds: name -> dtype. A file with other arrays or dtypes is refused.
COMMON_ARRAYS = {"labels": "<i4", "name_offsets": "<i8", "names": "|u1"}
KINDS: dict[str, dict[str, str]] = {
    "folder": {},  # a name: the path under its class folder (the label's)
    "zip": {  # a name: the member; where it is and what its directory says of it
        "header_offsets": "<i8",
        "compressed_sizes": "<i8",
        "sizes": "<i8",
        "crcs": "<u4",
        "methods": "<u2",
        "flags": "<u2",
    },
}

log = logging.getLogger(DATA_LOGGER)


@dataclass
class SampleIndex:
    """One split's samples: ``arrays["labels"][i]`` and the name ``i`` (bytes: a path under a class folder, a zip
    member), plus the kind's own per-sample arrays. ``meta`` holds small facts (a listing's subfolders); ``key``
    what was indexed (sizes and modification times), so a changed dataset is noticed; ``path`` the file it is
    mapped from."""

    kind: str
    key: dict[str, Any]
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: str | None = None
    _mapped: Any = field(default=None, repr=False)  # the mmap the arrays view: kept alive with them

    def __len__(self) -> int:
        return len(self.arrays["labels"])

    @property
    def labels(self) -> np.ndarray:
        return self.arrays["labels"]

    def name(self, index: int) -> bytes:
        offsets = self.arrays["name_offsets"]
        return self.arrays["names"][offsets[index] : offsets[index + 1]].tobytes()

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned worker maps the same file rather than receiving a copy of its arrays.
        if self.path is not None:
            return load_index, (self.path, self.kind, self.key)
        return SampleIndex, (self.kind, self.key, self.meta, self.arrays)


class IndexSamples(Sequence[tuple[str, int]]):
    """``(name, label)`` per sample, made when asked for (torchvision's ``samples``), from an index's arrays;
    ``prefix(label, name)`` turns a stored name into what a user sees (a path, a member name)."""

    def __init__(self, source: SampleIndex, prefix: Callable[[int, str], str]) -> None:
        self.source, self.prefix = source, prefix

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[str, int]:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        label = int(self.source.labels[i])
        return self.prefix(label, os.fsdecode(self.source.name(i))), label

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return (self[i] for i in range(len(self)))


def pack_names(names: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``(name_offsets, names)``: the names end to end in one byte buffer, name ``i`` at ``offsets[i]:offsets[i+1]``."""
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, names), dtype=np.int64, count=len(names)), out=offsets[1:])
    return offsets, np.frombuffer(b"".join(names), dtype=np.uint8)


def index_path(index_dir: str, kind: str, source: str) -> str:
    """Where the index of ``source`` (a split's folder or zip) lives in ``index_dir``: one file per source."""
    digest = hashlib.sha256(os.path.realpath(source).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(index_dir, f".index-{kind}-{digest}.bin")


def save_index(index: SampleIndex, path: str) -> None:
    """Write ``index`` to ``path`` atomically (module doc's layout), its arrays in their declared order and dtypes."""
    arrays = {
        name: np.ascontiguousarray(index.arrays[name], dtype=dtype)
        for name, dtype in {**COMMON_ARRAYS, **KINDS[index.kind]}.items()
    }
    layout, offset, digest = {}, 0, hashlib.sha256()
    for name, array in arrays.items():
        layout[name] = [array.dtype.str, len(array), offset]
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
        digest.update(array.data)
    header = {"kind": index.kind, "key": index.key, "meta": index.meta, "arrays": layout, "sha256": digest.hexdigest()}
    text = json.dumps({**header, "seal": seal(header)}, allow_nan=False).encode("utf-8")
    start = _body_start(len(text))

    def write(f: io.BufferedWriter) -> None:
        f.write(_PREAMBLE.pack(MAGIC, VERSION, len(text)) + text)
        f.write(bytes(start - _PREAMBLE.size - len(text)))
        for array in arrays.values():
            f.write(array.data)
            f.write(bytes(-array.nbytes % _ALIGN))

    atomic_write(path, write)


def _body_start(header_bytes: int) -> int:
    return -(-(_PREAMBLE.size + header_bytes) // _ALIGN) * _ALIGN


class _Invalid(Exception):
    """Why a file is no index of the expected kind and key (it is rebuilt)."""


def load_index(path: str, kind: str, key: Mapping[str, Any]) -> SampleIndex:
    """The index at ``path``, mapped read-only, checked as untrusted input (module doc) to hold ``kind``'s arrays
    (:data:`KINDS`) of this ``key``. An _Invalid says why not."""
    try:
        fd = open_owned(path)
    except OutputError as error:
        raise _Invalid(str(error)) from None
    try:
        size = os.fstat(fd).st_size
        if size < _PREAMBLE.size:
            raise _Invalid("shorter than its preamble")
        if size > _MAX_INDEX_BYTES:
            raise _Invalid(f"{size} bytes, more than any index cat writes")
        # Read into this process's own memory, not mapped from the file: a file truncated or rewritten while a run
        # reads it would end the process by SIGBUS at the next access to a page past its new end, without a word.
        # Forked loader workers share these pages (nothing writes them).
        mapped = mmap.mmap(-1, size)
        with open(fd, "rb", closefd=False) as file:
            if file.readinto(mapped) != size:
                raise _Invalid("shorter than when it was opened (truncated while it was read)")
    finally:
        os.close(fd)
    magic, version, length = _PREAMBLE.unpack_from(mapped, 0)
    if magic != MAGIC or version != VERSION:
        raise _Invalid(f"not a version-{VERSION} cat index")
    if length > min(_MAX_HEADER_BYTES, size - _PREAMBLE.size):
        raise _Invalid(f"a header of {length} bytes")
    try:
        header = json.loads(mapped[_PREAMBLE.size : _PREAMBLE.size + length].decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise _Invalid(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict) or header.get("kind") != kind:
        raise _Invalid(f"not a {kind} index")
    claimed = header.pop("seal", None)
    if not seal_holds(header, claimed):
        raise _Invalid("its seal does not hold (written by another user or with another key, or altered since)")
    if header.get("key") != dict(key):
        raise _Invalid("the dataset changed since it was built (sizes, times or listing)")
    declared = {**COMMON_ARRAYS, **KINDS[kind]}
    layout = header.get("arrays")
    if not isinstance(layout, dict) or set(layout) != set(declared):
        raise _Invalid(f"its arrays are not {sorted(declared)}")
    start = _body_start(length)
    views, digest = {}, hashlib.sha256()
    for name, dtype in declared.items():
        entry = layout[name]
        if not (isinstance(entry, list) and len(entry) == 3 and entry[0] == dtype):
            raise _Invalid(f"array {name}: expected dtype {dtype}, got {entry!r:.80}")
        _, count, offset = entry
        if not all(type(v) is int and v >= 0 for v in (count, offset)) or offset % _ALIGN:
            raise _Invalid(f"array {name}: length {count!r:.20} at offset {offset!r:.20}")
        nbytes = count * np.dtype(dtype).itemsize
        if start + offset + nbytes > size:
            raise _Invalid(f"array {name} runs past the file's end")
        views[name] = np.frombuffer(mapped, dtype=dtype, count=count, offset=start + offset)
        views[name].flags.writeable = False
        digest.update(views[name].data)
    if digest.hexdigest() != header.get("sha256"):
        raise _Invalid("its arrays do not match their checksum (altered or torn)")
    meta = header.get("meta")
    index = SampleIndex(kind, dict(key), meta if isinstance(meta, dict) else {}, views, path, mapped)
    problem = _shape_problem(index)
    if problem is not None:
        raise _Invalid(problem)
    return index


def _shape_problem(index: SampleIndex) -> str | None:
    """What is inconsistent between an index's arrays: lengths, and name offsets that do not walk the buffer."""
    count = len(index)
    offsets, names = index.arrays["name_offsets"], index.arrays["names"]
    if any(len(a) != count for n, a in index.arrays.items() if n not in ("name_offsets", "names")):
        return f"arrays of different lengths ({count} labels)"
    if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(names) or np.any(np.diff(offsets) < 0):
        return "its name offsets do not walk its name buffer"
    if count and (index.labels.min() < 0):
        return "a negative label"
    return None


def shared_index(
    index_dir: str | None,
    kind: str,
    source: str,
    key: Mapping[str, Any],
    build: Callable[[], SampleIndex],
    stale: Callable[[SampleIndex], str | None] | None = None,
) -> SampleIndex:
    """The index of ``source``: mapped from ``index_dir`` when a valid one of this ``key`` is there, else built,
    written there atomically and mapped (the build's arrays are dropped, so only the mapped pages stay). The
    processes that ask at once (a node's ranks) take turns on a lock beside the file: the first builds, the rest
    map what it wrote. Without ``index_dir`` it is built in memory. ``stale``: why a valid file no longer
    describes the dataset (what ``key`` cannot hold), or None."""
    if index_dir is None:
        return _checked_build(kind, source, build)
    os.makedirs(index_dir, exist_ok=True)
    path = index_path(index_dir, kind, source)
    with _locked(path + ".lock"):
        why = "no index yet"
        if os.path.lexists(path):
            started = time.perf_counter()
            try:
                index = load_index(path, kind, key)
                if stale is not None and (change := stale(index)) is not None:
                    raise _Invalid(change)
            except _Invalid as invalid:
                why = f"{path} was refused: {invalid}"
            else:
                log.info("read the index of %s (%d images) in %.2f s: %s", source, len(index), _since(started), path)
                return index
        started = time.perf_counter()
        save_index(_checked_build(kind, source, build), path)
        log.info("built the index of %s in %.2f s (%s); wrote %s", source, _since(started), why, path)
        return load_index(path, kind, key)


def _since(started: float) -> float:
    return time.perf_counter() - started


def _checked_build(kind: str, source: str, build: Callable[[], SampleIndex]) -> SampleIndex:
    index = build()
    declared = {**COMMON_ARRAYS, **KINDS[kind]}
    problem = _shape_problem(index) if set(index.arrays) == declared.keys() else f"arrays {sorted(index.arrays)}"
    if problem is not None:  # a bug in a builder, not bad data
        raise AssertionError(f"the {kind} index of {source}: {problem}")
    return index


def return_freed_memory() -> None:
    """Hand the heap pages a build or its checks freed back to the system (glibc keeps them otherwise, and a
    forked worker's allocator, reusing them, would copy them page by page)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` (a file the run owns; made if absent) for the body. Where the file system
    has no locks, the body runs unlocked: each process then builds its own, and the atomic writes keep the file
    whole."""
    fd = open_owned(path, "a")
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
