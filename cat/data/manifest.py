"""``manifest.json``, which ``tools/pack_dataset.py`` writes beside the files it packs.

``{"format": "zip"|"tar", "classes": [names], "order": ..., "files": {name: {"bytes", "images",
"sha256", "class_counts"?}}}``: each packed file's size, image count and sha256, and for a tar shard
how many images of each class it holds. Readers check what is cheap (sizes, and counts against what
the bytes can hold) before training; every field is type-checked, so a hand-edited or hostile manifest
is one line naming the field.
"""

from __future__ import annotations

import json
import os
from typing import Any

from cat.errors import DataError

from .untrusted import open_regular, require_regular

__all__ = ["MANIFEST", "read_manifest", "check_against_manifest", "TAR_SAMPLE_MIN_BYTES"]

MANIFEST = "manifest.json"
# A tar member takes a 512-byte header and at least one 512-byte block of data, and a sample is an
# image and a label: a shard of B bytes holds at most B // 2048 samples.
TAR_SAMPLE_MIN_BYTES = 2048


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _problem(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest's structure, or None."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if not isinstance(manifest.get("files"), dict):
        return "no 'files' table"
    classes = manifest.get("classes")
    if "classes" in manifest and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        return f"'classes' must be a list of class names, got {json.dumps(classes)[:60]}"
    for name, entry in manifest["files"].items():
        if not isinstance(entry, dict):
            return f"files[{name!r}] must be an object, got {json.dumps(entry)[:60]}"
        for field in ("bytes", "images"):
            if field in entry and not _count(entry[field]):
                return f"files[{name!r}].{field} must be a whole number >= 0, got {json.dumps(entry[field])[:60]}"
        counts = entry.get("class_counts")
        if "class_counts" in entry and not (isinstance(counts, list) and all(_count(n) for n in counts)):
            return f"files[{name!r}].class_counts must be a list of whole numbers, got {json.dumps(counts)[:60]}"
        if counts is not None and "images" in entry and sum(counts) != entry["images"]:
            return f"files[{name!r}]: class_counts add up to {sum(counts)}, not its {entry['images']} images"
        if counts is not None and isinstance(classes, list) and len(counts) != len(classes):
            return f"files[{name!r}].class_counts has {len(counts)} entries for {len(classes)} classes"
    return None


def read_manifest(root: str) -> dict[str, Any] | None:
    """``root/manifest.json`` as written by ``tools/pack_dataset.py``, checked field by field; None when
    there is none."""
    path = os.path.join(root, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        with open_regular(path) as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DataError(f"{path} is not a dataset manifest ({error}); re-run tools/pack_dataset.py") from None
    problem = _problem(manifest)
    if problem is not None:
        raise DataError(f"{path} is not a dataset manifest ({problem}); re-run tools/pack_dataset.py")
    return manifest


def check_against_manifest(path: str, manifest: dict[str, Any] | None, images: int | None = None) -> None:
    """``path`` against its manifest entry (if any): its size, and ``images`` (what a reader counted)."""
    entry = (manifest or {}).get("files", {}).get(os.path.basename(path))
    if entry is None:
        return
    size = require_regular(path).st_size
    if "bytes" in entry and size != entry["bytes"]:
        raise DataError(
            f"{path} has {size} bytes, its manifest says {entry['bytes']}: the file is truncated or was "
            "replaced; re-copy it or re-run tools/pack_dataset.py"
        )
    if images is not None and "images" in entry and images != entry["images"]:
        raise DataError(
            f"{path}: its image list has {images} images, {os.path.join(os.path.dirname(path), MANIFEST)} says "
            f"{entry['images']}; re-run tools/pack_dataset.py"
        )
