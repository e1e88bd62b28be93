"""Where a checkpoint's name points, as mmengine fetches it: a path as it is; a URL or a model-zoo name
(``https://``, ``torchvision://``, ``open-mmlab://``, ``mmcls://``) resolved through mmengine's own tables and
downloaded into (or found in) torch's hub cache. Reading the file is :mod:`cat.mm.safe_load`'s."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import torch

from cat.errors import CheckpointError
from cat.models import check_name_hash

__all__ = ["REMOTE_PREFIXES", "local_checkpoint"]

REMOTE_PREFIXES = ("http://", "https://", "torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")


def _resolve_remote(filename: str) -> str:
    """The URL (or, for a local ``open-mmlab`` table entry, the path) a scheme name stands for,
    through mmengine's own tables."""
    from mmengine.runner import checkpoint as mm_checkpoint

    if filename.startswith(("http://", "https://")):
        return filename
    scheme, _, name = filename.partition("://")
    if scheme in ("torchvision", "modelzoo"):
        table = mm_checkpoint.get_torchvision_models()
    elif scheme in ("open-mmlab", "openmmlab"):
        name = mm_checkpoint.get_deprecated_model_names().get(name, name)
        table = mm_checkpoint.get_external_models()
    else:  # mmcls
        table = mm_checkpoint.get_mmcls_models()
    if name not in table:
        raise CheckpointError(f"checkpoint {filename}: mmengine's {scheme}:// table has no model named {name!r}")
    location = table[name]
    if location.startswith(("http://", "https://")):
        return location
    return os.path.join(mm_checkpoint._get_mmengine_home(), location)


def _cached_download(url: str) -> str:
    """The file for ``url`` in torch's hub cache (where torch and mmengine keep downloads),
    downloaded first if it is not there; the download itself runs no code."""
    name = os.path.basename(urlparse(url).path)
    if not name:
        raise CheckpointError(f"checkpoint {url}: the URL names no file")
    path = os.path.join(torch.hub.get_dir(), "checkpoints", name)
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, path, progress=False)
        except OSError as error:  # URLError, HTTPError and socket errors are OSErrors
            raise CheckpointError(
                f"checkpoint {url}: download failed ({error}); download it and pass its path"
            ) from None
    return path


def local_checkpoint(filename: str) -> str:
    """The local file a checkpoint name stands for, as mmengine would fetch it: a path as it is; a URL or a
    model-zoo name (``https://``, ``torchvision://``, ``open-mmlab://``...) downloaded into (or found in) torch's hub
    cache, its torch.hub-style name's hash checked. Reading it is the safe loader's."""
    if not filename.startswith(REMOTE_PREFIXES):
        return filename
    location = _resolve_remote(filename)
    path = _cached_download(location) if location.startswith(("http://", "https://")) else location
    check_name_hash(path)
    return path
