"""Reading files a dataset's owner (or anyone with write access to a shared folder) controls.

Every reader in :mod:`cat.data` opens its files here: only regular files are opened (a FIFO or a
device named like an image or a shard would block ``open()`` forever), one image's bytes are bounded
before they are read or inflated (``data.max_image_mb``), an image that cannot be decoded (or that
decodes to more pixels than PIL allows: a decompression bomb) is one line naming it, and labels are
checked to be ``0 ... K-1``. Shards written class by class are detected from their class counts.
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import BinaryIO, TypeVar

import numpy as np
from PIL import Image

from cat.errors import DataError
from cat.runtime.logger import DATA_LOGGER

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_IMAGE_MB",
    "open_regular",
    "require_regular",
    "image_limit",
    "check_image_size",
    "file_stamp",
    "decode_image",
    "as_rgb",
    "parse_label",
    "check_labels",
    "check_label_array",
    "class_sorted",
    "warn_class_sorted",
]

DEFAULT_MAX_IMAGE_MB = 64.0  # far above any photograph in a training set; a bomb is far above it
_LABEL = re.compile(rb"\s*([0-9]{1,18})\s*")  # ASCII digits that fit an int64 (not '²', not 10**30)

log = logging.getLogger(DATA_LOGGER)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def require_regular(path: str) -> os.stat_result:
    """``path``'s stat (symlinks followed) if it is a regular file; otherwise one line naming it."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise DataError(f"cannot read {path} ({error.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"{path} is {_kind(info.st_mode)}, not a regular file: datasets are read from regular files")
    return info


def file_stamp(info: os.stat_result) -> list[int]:
    """What a cache of a file's contents is keyed by: its inode, size, and modification and change times (a rewrite
    moves the change time, which no one can set back, whatever the modification time is set to)."""
    return [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def open_regular(path: str, follow_links: bool = True) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file. Opened non-blocking and checked on the open
    descriptor, so a FIFO swapped in after a check cannot block; the file then reads as usual. ``follow_links``
    False: a symbolic link at the last part of ``path`` is refused (``O_NOFOLLOW``), not followed."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_links:
            raise DataError(f"{path} is a symbolic link where a file was read: refused, not followed") from None
        raise DataError(f"cannot read {path} ({error.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DataError(f"{path} is {_kind(mode)}, not a regular file: datasets are read from regular files")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def image_limit(max_image_mb: float | None) -> int:
    """``data.max_image_mb`` in bytes (the default where a config has none)."""
    return int((DEFAULT_MAX_IMAGE_MB if max_image_mb is None else max_image_mb) * 1e6)


def check_image_size(size: int, limit: int, name: str) -> None:
    """Refuse one image (a file, a zip member, a tar member) whose size, as its directory or header
    says before anything is read or inflated, is over ``limit`` bytes."""
    if size > limit:
        raise DataError(
            f"{name} is {size / 1e6:.1f} MB, over data.max_image_mb={limit / 1e6:g} (a decompression bomb, or a "
            "file that is no training image); remove it, or raise data.max_image_mb"
        )


def decode_image(data: bytes | BinaryIO, name: str, read: Callable[[Image.Image], T] | None = None) -> T | Image.Image:
    """An encoded image as RGB; anything PIL refuses (truncated, not an image, a pixel bomb) names ``name``.
    ``read``: what to make of the opened, not yet decoded image instead: decode it at a reduced scale
    (:class:`~cat.data.images.DraftCrop`), or read its header alone."""
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
            return read(image) if read is not None else as_rgb(image)
    except Image.UnidentifiedImageError:  # its own text names a file object, not the file
        reason = "not an image PIL can identify"
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        reason = f"{type(error).__name__}: {error}"
    raise DataError(f"cannot read {name} ({reason}); replace or remove it")


# Pillow's 16-bit greyscale modes: ``convert("RGB")`` clips their 0..65535 at 255 rather than scaling them.
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def as_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, a 16-bit greyscale one scaled by its real range (200/65535 is black, not 200/255)."""
    if image.mode in _SIXTEEN_BIT:
        image = Image.fromarray((np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8), mode="L")
    return image.convert("RGB")


def parse_label(data: bytes, name: str) -> int:
    """A ``.cls`` payload or a map's label field: ASCII digits, at most 18 of them."""
    match = _LABEL.fullmatch(data)
    if match is None:
        shown = data[:24].decode("utf-8", "replace") + ("..." if len(data) > 24 else "")
        raise DataError(f"{name}: label {shown!r} is not a class index (0, 1, ..., in ASCII digits)")
    return int(match[1])


def check_labels(labels: Iterable[tuple[int, str]], num_classes: int | None, source: str) -> int:
    """The class count K of ``labels`` (``(label, where it was read)`` pairs), each checked to be in
    ``0 ... K-1`` (:func:`check_label_array`)."""
    pairs = list(labels)
    found = np.fromiter((label for label, _ in pairs), dtype=np.int64, count=len(pairs))
    return check_label_array(found, num_classes, source, lambda i: pairs[i][1])


def check_label_array(labels: np.ndarray, num_classes: int | None, source: str, where: Callable[[int], str]) -> int:
    """The class count K of ``labels`` (an array; ``where(i)`` says where label ``i`` was read), each checked to
    be in ``0 ... K-1``. K is ``num_classes`` when given, else the number of distinct labels: then any label at or
    above it means the labels are not ``0 ... K-1``, and the first such one is named."""
    derived = num_classes is None
    count = len(np.unique(labels)) if num_classes is None else num_classes
    bad = np.flatnonzero(labels >= count)
    if bad.size:
        rule = (
            f"its {count} distinct labels are not 0 ... {count - 1} (set data.num_classes if classes are missing)"
            if derived
            else f"not one of the {count} classes"
        )
        raise DataError(f"{where(int(bad[0]))}: label {labels[bad[0]]}: {rule}")
    if count == 0:
        raise DataError(f"{source} holds no labelled images")
    return count


def class_sorted(shards: Mapping[str, Mapping[int, int]]) -> list[str]:
    """The shards (name -> class counts) that hold far fewer classes than the same number of samples drawn
    at random from the whole split would: under half the expected number of distinct classes."""
    totals: dict[int, int] = {}
    for counts in shards.values():
        for label, n in counts.items():
            totals[label] = totals.get(label, 0) + n
    everything = sum(totals.values())
    flagged = []
    for name, counts in shards.items():
        size = sum(counts.values())
        expected = sum(1 - (1 - n / everything) ** size for n in totals.values())
        if expected >= 2 and sum(1 for n in counts.values() if n) < expected / 2:
            flagged.append(name)
    return flagged


def warn_class_sorted(shards: Mapping[str, Mapping[int, int]], buffer: int) -> bool:
    """Warn (once per call) when most shards are class-sorted: a shuffle buffer then mixes only a few
    classes, every batch holds a handful of them, and accuracy drops without another sign."""
    flagged = class_sorted(shards)
    if len(flagged) * 2 < len(shards) or not flagged:
        return False
    held = {name: len([n for n in counts.values() if n]) for name, counts in shards.items()}
    classes = len({label for counts in shards.values() for label, n in counts.items() if n})
    named = ", ".join(f"{os.path.basename(n)} ({held[n]} of {classes} classes)" for n in flagged[:3])
    log.warning(
        "%d of %d training shards are class-sorted (%s%s): the shuffle buffer (data.shuffle_buffer=%d) mixes only "
        "a few classes, so each batch holds a few classes and the run loses accuracy. Re-pack with "
        "tools/pack_dataset.py --format tar (it writes a shuffled order), or raise data.shuffle_buffer to several "
        "shards' worth of samples",
        len(flagged),
        len(shards),
        named,
        ", ..." if len(flagged) > 3 else "",
        buffer,
    )
    return True
