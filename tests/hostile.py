"""Hostile checkpoint files: each one, if unpickled carelessly, creates its marker file.

Used by the malicious-file suite against every entry point that reads a checkpoint. The payload is
``touch MARKER`` through ``os.system`` (or ``eval``), so a test proves nothing ran by the marker's
absence as well as by the refusal message.
"""

from __future__ import annotations

import collections
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
    """The suite: name -> file. Each would run ``touch marker`` (``build_on_class``: write
    ``marker.patch``; ``build_on_tensor``: set a tensor's backward hooks) if loaded unsafely."""
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
    write_build_on_class(path("build_on_class"), str(marker))  # its payload writes f"{marker}.patch"
    write_build_on_tensor(path("build_on_tensor"))
    return files


# -- BUILD on allow-listed objects (second pass) ---------------------------------------------------


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _legacy_file(main_pickle: bytes) -> bytes:
    """A torch legacy-format checkpoint (magic, protocol, sys info, object, storage keys) around
    ``main_pickle``, which holds no storages."""
    out = io.BytesIO()
    pickle.dump(0x1950A86A20F9469CFC6C, out, protocol=2)
    pickle.dump(1001, out, protocol=2)
    pickle.dump(
        {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}},
        out,
        protocol=2,
    )
    out.write(main_pickle)
    pickle.dump([], out, protocol=2)
    return out.getvalue()


class _BuildState:
    """Pickles as ``func(*args)`` followed by BUILD ``state``."""

    def __init__(self, func, args, state) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args, self.state)


def write_build_on_tensor(path: Path) -> None:
    """A release-style file (a yacs config, so torch's weights-only reader refuses it and cat's
    restricted reader reads it) whose tensor gets BUILD ``(False, None, {0: set})``: Tensor.__setstate__
    sets ``_backward_hooks`` after the rebuild function checked there were none."""
    rebuild, args = torch.zeros(2).__reduce_ex__(2)[:2]
    hooks = collections.OrderedDict({0: set})
    torch.save(
        {"config": _fake_yacs_cfgnode({}), "model": {"w": _BuildState(rebuild, args, (False, None, hooks))}}, path
    )


def write_build_on_class(path: Path, patch_stem: str) -> None:
    """A legacy-format file that BUILDs ``(None, {dump_patches: True, __name__: patch_stem})`` onto
    the allow-listed yacs stand-in *class*, then names that class in a 'module' persistent id:
    torch's legacy source check then writes ``patch_stem + '.patch'`` with the file's text."""
    main = (
        b"\x80\x02cyacs.config\nCfgNode\nq\x00N}("
        + _unicode("dump_patches")
        + b"\x88"
        + _unicode("__name__")
        + _unicode(patch_stem)
        + b"u\x86b0("
        + _unicode("module")
        + b"h\x00"
        + _unicode("evil.py")
        + _unicode("attacker's text\n")
        + b"tQ."
    )
    path.write_bytes(_legacy_file(main))


def load_with_pickles_own_build(path: Path):
    """Read ``path`` the way cat's restricted reader did before BUILD was checked: the same global
    allow-list, pickle's own BUILD. For proving that the BUILD payloads fire."""
    from cat.models.loading import RestrictedUnpickler

    class OwnBuild(pickle.Unpickler):
        find_class = RestrictedUnpickler.find_class

    class PickleModule:
        Unpickler = OwnBuild
        UnpicklingError = pickle.UnpicklingError

        @staticmethod
        def load(file, **kwargs):
            return OwnBuild(file, **kwargs).load()

    return torch.load(path, weights_only=False, pickle_module=PickleModule)
