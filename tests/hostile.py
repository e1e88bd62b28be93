"""Hostile checkpoint files: each one, if unpickled carelessly, creates its marker file.

Used by the malicious-file suite against every entry point that reads a checkpoint. The payload is
``touch MARKER`` through ``os.system`` (or ``eval``), so a test proves nothing ran by the marker's
absence as well as by the refusal message.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
import zipfile
from pathlib import Path

import torch


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _state(payload: object) -> dict:
    return {"model": {"w": torch.zeros(2)}, "payload": payload}


def _fake_yacs_cfgnode(payload: object) -> object:
    """A dict subclass that pickles as ``yacs.config.CfgNode`` (the release format's config), with the
    payload among its entries, the way a doctored release checkpoint would carry it."""
    module = types.ModuleType("yacs.config")
    cfg_node = type("CfgNode", (dict,), {"__module__": "yacs.config"})
    module.CfgNode = cfg_node
    sys.modules.setdefault("yacs", types.ModuleType("yacs"))
    sys.modules["yacs.config"] = module
    return cfg_node({"DATA": {"IMG_SIZE": 64}, "EVIL": payload})


def _getattr_chain_pickle(command: str) -> bytes:
    """``_rebuild_from_type_v2(getattr(getattr(getattr, '__self__'), 'eval'), Tensor, (code,), {})``:
    runs code under ``weights_only=True`` wherever ``builtins.getattr`` is allow-listed."""
    code = f"__import__('os').system({command!r})".encode()

    def unicode(text: bytes) -> bytes:
        return b"X" + len(text).to_bytes(4, "little") + text

    return (
        b"\x80\x02"
        + b"c__builtin__\ngetattr\nq\x00"
        + b"h\x00h\x00"
        + unicode(b"__self__")
        + b"\x86R"
        + b"q\x01"
        + b"h\x00h\x01"
        + unicode(b"eval")
        + b"\x86R"
        + b"q\x02"
        + b"ctorch._tensor\n_rebuild_from_type_v2\n(h\x02ctorch\nTensor\n"
        + unicode(code)
        + b"\x85}tR."
    )


def _zip_with_pickle(data_pkl: bytes) -> bytes:
    """A torch zip checkpoint whose ``data.pkl`` is ``data_pkl``."""
    buffer = io.BytesIO()
    torch.save({"x": 1}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for item in source.infolist():
            target.writestr(item, data_pkl if item.filename.endswith("/data.pkl") else source.read(item.filename))
    return out.getvalue()


def write_hostile_files(folder: Path, marker: Path) -> dict[str, Path]:
    """The suite: name -> file. Each would run ``touch marker`` if loaded unsafely."""
    folder.mkdir(parents=True, exist_ok=True)
    command = f"touch {marker}"
    files = {}

    def path(name: str) -> Path:
        files[name] = folder / f"{name}.pth"
        return files[name]

    with open(path("plain_pickle"), "wb") as f:
        pickle.dump({"model": _RunsCommand(command)}, f)
    torch.save(_state(_RunsCommand(command)), path("legacy_torch"), _use_new_zipfile_serialization=False)
    torch.save(_state(_RunsCommand(command)), path("zip_torch"))
    torch.save(
        {"model": {"w": torch.zeros(2)}, "epoch": 1, "config": _fake_yacs_cfgnode(_RunsCommand(command))},
        path("yacs_config_payload"),
    )
    path("getattr_chain").write_bytes(_zip_with_pickle(_getattr_chain_pickle(command)))
    # A reducer nested deep inside allowed containers (dict, list, tuple, OrderedDict).
    nested = torch.nn.Module().state_dict()
    nested["layer"] = [{"inner": (_RunsCommand(command),)}]
    torch.save({"model": nested}, path("nested_reducers"))
    return files
