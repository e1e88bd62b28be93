"""Image folders read by one rule, the packer's and the reader's alike: a split's class folders are real folders
(a link to a folder is refused by name), and its images are the regular files that resolve inside the dataset's
root; links to folders are not entered, and every entry left out is named, so that a link to ``/usr/share`` or a
loop back into the class folder is never read as images."""

from __future__ import annotations

import array
import functools
import os
import stat
from dataclasses import dataclass

import numpy as np

from cat.errors import DataError

from .index import SampleIndex, pack_names, shared_index

__all__ = [
    "IMAGE_EXTENSIONS",
    "FolderListing",
    "class_folders",
    "list_images",
    "folder_index",
    "escaping_name",
    "is_within",
    "split_images",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def utf8_name(name: str) -> str:
    """A file name as UTF-8 text; one that is not (bytes the file system kept as they were) is a ValueError
    holding the bytes."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(repr(os.fsencode(name))[1:]) from None
    return name


def class_folders(split: str) -> list[str]:
    """The split's class folders: real folders (not links) with UTF-8 names, sorted as ImageFolder sorts them."""
    names = []
    for entry in sorted(os.scandir(split), key=lambda e: e.name):
        if entry.is_symlink() and entry.is_dir():
            raise DataError(
                f"{entry.path} is a symbolic link to a folder ({os.path.realpath(entry.path)}): a dataset is read "
                "from inside its root; copy the class folder in, or point data.root at its real location"
            )
        if entry.is_dir(follow_symlinks=False):
            try:
                names.append(utf8_name(entry.name))
            except ValueError as error:
                raise DataError(f"class folder {split}/{error}: its name is not UTF-8; rename it") from None
    return names


@dataclass
class FolderListing:
    """A split's images, as listed once: the name of each under its class folder (file-system bytes, possibly a
    path through subfolders) and its label (the class's index), in torchvision ImageFolder's order; the entries
    left out, each with why; and every subfolder walked (relative to the split, with its modification time), so
    a listing kept from an earlier run can be checked to be current."""

    names: list[bytes]
    labels: np.ndarray
    left_out: list[str]
    subfolders: list[tuple[str, int]]


def list_images(folder: str, classes: list[str], root: str) -> FolderListing:
    """Every image under the class folders ``classes`` of ``folder`` (:class:`FolderListing`): regular files that
    resolve inside ``root``, one ``scandir`` of each folder; links to folders are named and not entered."""
    inside = os.path.realpath(root)
    # A plain file in a real folder under a split inside the root is inside it; only links need resolving.
    split_inside = is_within(os.path.realpath(folder), inside)
    names: list[bytes] = []
    labels = array.array("i")
    left_out: list[str] = []
    subfolders: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        top = os.path.join(folder, name)
        for relative, regular, others in _walk(top, left_out):
            if relative:
                subfolders.append((os.path.join(name, relative), os.stat(os.path.join(top, relative)).st_ctime_ns))
            kept = [file for file in regular if file.lower().endswith(IMAGE_EXTENSIONS)]
            if not split_inside:
                others, kept = [os.path.join(top, relative, file) for file in kept] + others, []
            for path in sorted(p for p in others if p.lower().endswith(IMAGE_EXTENSIONS)):
                if (reason := _refusal(path, inside)) is None:
                    kept.append(os.path.basename(path))
                else:
                    left_out.append(f"{path}: {reason}")
            if kept:  # one encoding per folder: a name holds no NUL
                kept.sort()
                names += os.fsencode(
                    "\0".join(os.path.join(relative, f) for f in kept) if relative else "\0".join(kept)
                ).split(b"\0")
                labels.extend([label] * len(kept))
    return FolderListing(names, np.frombuffer(labels, dtype=np.int32), left_out, subfolders)


def folder_index(folder: str, classes: list[str], root: str, index_dir: str | None) -> SampleIndex:
    """The split ``folder``'s :func:`list_images` as a :class:`~cat.data.index.SampleIndex` (names under their
    class folders), shared through ``index_dir`` (:func:`~cat.data.index.shared_index`): keyed by the split, the
    root, and each class folder's name and change time (a file added, removed or renamed changes it, and unlike the
    modification time it cannot be set back), each subfolder's checked when it is read."""
    key = {
        "split": os.path.realpath(folder),
        "root": os.path.realpath(root),
        "classes": [[name, os.stat(os.path.join(folder, name)).st_ctime_ns] for name in classes],
    }

    def build() -> SampleIndex:
        listing = list_images(folder, classes, root)
        offsets, names = pack_names(listing.names)
        left_out = listing.left_out
        meta = {"subfolders": listing.subfolders, "left_out": left_out[:3], "left_out_count": len(left_out)}
        return SampleIndex("folder", key, meta, {"labels": listing.labels, "name_offsets": offsets, "names": names})

    return shared_index(index_dir, "folder", folder, key, build, lambda index: _changed_subfolder(folder, index))


def _changed_subfolder(folder: str, index: SampleIndex) -> str | None:
    """Why a kept listing's subfolders are not as they were (its meta is untrusted too), or None."""
    subfolders, count = index.meta.get("subfolders"), index.meta.get("left_out_count")
    if not isinstance(subfolders, list) or type(count) is not int or not isinstance(index.meta.get("left_out"), list):
        return "its listing's facts are malformed"
    for entry in subfolders:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and type(entry[1]) is int):
            return "its listing's facts are malformed"
        try:
            if os.stat(os.path.join(folder, entry[0]), follow_symlinks=False).st_ctime_ns != entry[1]:
                return f"{entry[0]} changed"
        except OSError:
            return f"{entry[0]} is gone"
    return None


def escaping_name(index: SampleIndex) -> int | None:
    """The first sample whose name could lead out of its class folder (empty, absolute, a ``..`` step or a NUL
    byte: none that a listing makes, so an altered index), or None."""
    offsets, names = index.arrays["name_offsets"], index.arrays["names"]
    starts, ends = offsets[:-1], offsets[1:]
    bad = ends == starts
    bad[starts < ends] |= names[starts[starts < ends]] == ord("/")
    owner = functools.partial(np.searchsorted, offsets, side="right")
    bad[owner(np.flatnonzero(names == 0)) - 1] = True
    dots = np.flatnonzero((names[:-1] == ord(".")) & (names[1:] == ord(".")))
    sample = np.asarray(owner(dots)) - 1
    opens = (offsets[sample] == dots) | (names[np.maximum(dots - 1, 0)] == ord("/"))
    closes = (offsets[sample + 1] == dots + 2) | (names[np.minimum(dots + 2, len(names) - 1)] == ord("/"))
    bad[sample[opens & closes]] = True
    found = np.flatnonzero(bad)
    return int(found[0]) if found.size else None


def split_images(folder: str, classes: list[str], root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """``(path, label)`` of every image :func:`list_images` lists, and the entries it left out."""
    listing = list_images(folder, classes, root)
    paths = [
        (os.path.join(folder, classes[label], os.fsdecode(name)), label)
        for name, label in zip(listing.names, listing.labels.tolist(), strict=True)
    ]
    return paths, listing.left_out


def _walk(top: str, left_out: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """``(folder relative to top, its regular files' names, the paths of its other entries that are no folders:
    links, FIFOs, ...)`` for ``top`` and each real subfolder, in the order ``sorted(os.walk(top))`` gives; a link
    to a folder is left out, with why."""
    found, pending = [], [""]
    while pending:
        relative = pending.pop()
        path = os.path.join(top, relative) if relative else top
        try:
            with os.scandir(path) as listing:
                entries = list(listing)
        except OSError as error:
            left_out.append(f"{path}: cannot be listed ({error.strerror})")
            continue
        regular = [entry.name for entry in entries if entry.is_file(follow_symlinks=False)]  # no stat: d_type
        others = []
        if len(regular) < len(entries):
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    continue
                if not _is_dir(entry):
                    others.append(entry.path)
                elif entry.is_symlink():
                    left_out.append(f"{entry.path}: a symbolic link to a folder (not followed)")
                else:
                    pending.append(os.path.join(relative, entry.name))
        found.append((relative, regular, others))
    return sorted(found, key=lambda listed: listed[0])


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # links followed: a link to a folder is a folder here, as os.walk sorts it
    except OSError:
        return False


def is_within(path: str, inside: str) -> bool:
    """Whether the resolved ``path`` is ``inside`` (a resolved folder) or under it."""
    return os.path.commonpath([path, inside]) == inside


def _refusal(path: str, inside: str) -> str | None:
    """Why ``path`` is left out, or None: it must resolve to a regular file under ``inside``."""
    real = os.path.realpath(path)
    if not is_within(real, inside):
        return f"leads outside the dataset's folder (to {real})"
    try:
        mode = os.stat(real).st_mode
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    return None if stat.S_ISREG(mode) else "not a regular file"
