"""Image folders read by one rule, the packer's and the reader's alike: a split's class folders are real folders
(a link to a folder is refused by name), and its images are the regular files that resolve inside the dataset's
root; links to folders are not entered, and every entry left out is named, so that a link to ``/usr/share`` or a
loop back into the class folder is never read as images."""

from __future__ import annotations

import os
import stat

from cat.errors import DataError

__all__ = ["IMAGE_EXTENSIONS", "class_folders", "split_images"]

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


def split_images(folder: str, classes: list[str], root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """``(path, label)`` of every image under the class folders ``classes`` of ``folder``, in torchvision
    ImageFolder's order (label: the class's index), one listing of each folder; and the entries left out, each
    with why: a link to a folder (not entered), or a file that is not a regular file inside ``root`` once links
    are resolved."""
    inside = os.path.realpath(root)
    images, refused = [], []
    for label, name in enumerate(classes):
        for directory, subfolders, files in sorted(os.walk(os.path.join(folder, name))):  # links: not entered
            subfolders.sort()
            for link in [d for d in subfolders if os.path.islink(os.path.join(directory, d))]:
                refused.append(f"{os.path.join(directory, link)}: a symbolic link to a folder (not followed)")
            for file in sorted(files):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    path = os.path.join(directory, file)
                    reason = _refusal(path, inside)
                    if reason is None:
                        images.append((path, label))
                    else:
                        refused.append(f"{path}: {reason}")
    return images, refused


def _refusal(path: str, inside: str) -> str | None:
    """Why ``path`` is left out, or None: it must resolve to a regular file under ``inside``."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, inside]) != inside:
        return f"leads outside the dataset's folder (to {real})"
    try:
        mode = os.stat(real).st_mode
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    return None if stat.S_ISREG(mode) else "not a regular file"
