"""mmengine's checkpoints through cat's one safe loader, stripped of what would run, and written atomically.

mmengine 0.10.7 reads checkpoints with a bare ``torch.load`` and writes them with a plain
``open(path, 'wb')``. Its checkpoints hold the message hub's ``HistoryBuffer`` (numpy arrays
inside, and its statistics methods pickled as ``getattr(HistoryBuffer, 'mean')``). So:

- every scheme of mmengine's ``CheckpointLoader`` ends in :func:`cat.models.load_checkpoint_file`
  with exactly those globals allowed for that one call: local paths directly, ``http(s)://`` after a
  download into (or a look-up in) torch's hub cache, ``torchvision://``, ``open-mmlab://`` and
  ``mmcls://`` after mmengine's name-to-URL tables; any other scheme is refused. ``builtins.getattr``
  itself is never allowed: the name maps to :func:`_history_buffer_method`, which resolves
  HistoryBuffer's statistics methods and nothing else (a real ``getattr`` reaches ``builtins.eval``);
- what mmengine does with a loaded checkpoint is limited by :func:`sanitize_mm_checkpoint`: the
  config text it would execute (``Runner.resume`` runs ``meta['config']`` as Python) never reaches it,
  and the file paths it would delete come only from the checkpoint's own folder;
- checkpoints and the ``last_checkpoint`` pointer are written through an atomic file backend.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from cat.errors import CheckpointError
from cat.models import (
    CheckpointMismatchError,
    LoadReport,
    UnsafeCheckpointError,
    extract_state_dict,
    load_checkpoint_file,
)
from cat.runtime.io import atomic_write_bytes

from .fetch import REMOTE_PREFIXES, local_checkpoint

__all__ = [
    "ATOMIC_BACKEND",
    "LAST_CHECKPOINT",
    "MM_META_EXECUTED",
    "check_last_checkpoint",
    "check_weights_match",
    "install_safe_checkpoint_io",
    "register_atomic_backend",
    "load_from_safe_local",
    "load_from_safe_remote",
    "mmengine_safe_globals",
    "refuse_object_arrays",
    "sanitize_mm_checkpoint",
]

ATOMIC_BACKEND = "cat_atomic_local"
# HistoryBuffer's built-in statistics (its registry of them fills only once an instance exists).
_HISTORY_BUFFER_STATISTICS = ("min", "max", "mean", "current")


def _history_buffer_method(owner: Any, name: str) -> Any:
    """What mmengine's pickles use ``getattr`` for: one of HistoryBuffer's statistics methods."""
    from mmengine.logging.history_buffer import HistoryBuffer

    allowed = {*_HISTORY_BUFFER_STATISTICS, *HistoryBuffer._statistics_methods}
    if owner is HistoryBuffer and isinstance(name, str) and name in allowed:
        return getattr(HistoryBuffer, name)
    raise pickle.UnpicklingError(
        f"refused global 'builtins.getattr' on {owner!r}.{name}: only HistoryBuffer's statistics methods are allowed"
    )


def mmengine_safe_globals() -> list[Any]:
    """The globals an mmengine checkpoint needs beyond tensors (scoped to one load, never process-wide)."""
    from mmengine.logging.history_buffer import HistoryBuffer

    core = np._core if hasattr(np, "_core") else np.core
    return [
        HistoryBuffer,
        core.multiarray._reconstruct,
        core.multiarray.scalar,
        np.ndarray,
        np.dtype,
        *{type(np.dtype(t)) for t in _PLAIN_DTYPES},
        (_history_buffer_method, "builtins.getattr"),
    ]


# numpy arrays and scalars of these hold numbers, booleans or text, nothing else (a stock checkpoint's palettes,
# class names and statistics); an object array would unpickle anything and is refused (its reconstruction by the
# reader, one made by numpy's constructors after it: refuse_object_arrays).
_PLAIN_DTYPES: tuple[str, ...] = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_PLAIN_DTYPES += ("float16", "float32", "float64", "complex64", "complex128", "U", "S")


# The ``meta`` entries that never reach mmengine: ``Runner.resume`` executes ``meta['config']`` as a Python config
# file (mmcv 1.x wrote it as ``cfg`` too). Everything else in ``meta`` is data a stock checkpoint carries and stock
# tools read as data (mmdet 2.x's ``CLASSES``, mmseg 0.x's ``PALETTE``, versions, ``dataset_meta``, the loop
# position), and stays.
MM_META_EXECUTED = frozenset({"config", "cfg"})
# CheckpointHook deletes the file its message-hub entry ``best_ckpt*`` names when a new best arrives.
_BEST_CHECKPOINT_NAME = re.compile(r"best_[\w.\-]+\.pth")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _own_best_checkpoint(value: Any, folder: str) -> bool:
    """A ``best_*.pth`` path in ``folder`` (where mmengine wrote it), not a path anywhere else."""
    return (
        isinstance(value, str)
        and _BEST_CHECKPOINT_NAME.fullmatch(os.path.basename(value)) is not None
        and os.path.realpath(os.path.dirname(value)) == os.path.realpath(folder)
    )


def sanitize_mm_checkpoint(checkpoint: Any, path: str) -> Any:
    """What of a loaded mmengine checkpoint (read from ``path``) reaches mmengine.

    - ``meta``: all but :data:`MM_META_EXECUTED`; ``epoch``/``iter`` must be counts (else CheckpointError).
    - ``message_hub.runtime_info``: ``best_ckpt*`` kept only where it names a ``best_*.pth`` beside
      ``path``, ``keep_ckpt_ids`` only as a list of counts (CheckpointHook deletes the files these
      name), no ``cfg`` (mmengine's inferencers execute it); everything else there is loop state and metrics,
      used as numbers. ``log_scalars`` written as plain
      data (:class:`cat.mm.portable.PortableCheckpointHook`) become mmengine's HistoryBuffers again.
    - ``param_schedulers``: no ``optimizer`` entry (mmengine's schedulers ``__dict__.update`` their
      state, and never save that one).
    Weights, optimizer state and the rest are data (tensors, numbers, strings) and stay.
    """
    from .portable import restore_message_hub  # needs mmengine, as every caller of this function does

    if not isinstance(checkpoint, dict):
        return checkpoint
    meta = checkpoint.get("meta")
    if meta is not None:
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {path}: 'meta' is a {type(meta).__name__}, expected a dict")
        meta = {key: value for key, value in meta.items() if key not in MM_META_EXECUTED}
        for key in ("epoch", "iter"):
            if key in meta and not _is_count(meta[key]):
                raise CheckpointError(f"checkpoint {path}: meta.{key} is {meta[key]!r}, expected a count (int >= 0)")
        if meta.get("seed") is not None and not (_is_count(meta["seed"]) and meta["seed"] < 2**32):
            raise CheckpointError(f"checkpoint {path}: meta.seed is {meta['seed']!r}, expected an int in [0, 2**32)")
        checkpoint["meta"] = meta
    hub = restore_message_hub(checkpoint.get("message_hub"))
    if isinstance(hub, dict) and isinstance(hub.get("runtime_info"), dict):
        folder = os.path.dirname(os.path.abspath(path))
        info = hub["runtime_info"]
        for key in [k for k in info if isinstance(k, str) and k.startswith("best_ckpt")]:
            if not _own_best_checkpoint(info[key], folder):
                del info[key]
        info.pop("cfg", None)  # mmengine's inferencers execute it as a Python config, as Runner.resume meta's
        ids = info.get("keep_ckpt_ids")
        if ids is not None and not (isinstance(ids, list) and all(_is_count(i) for i in ids)):
            del info["keep_ckpt_ids"]
    schedulers = checkpoint.get("param_schedulers")
    for state in schedulers.values() if isinstance(schedulers, dict) else schedulers or ():
        for item in state if isinstance(state, list) else [state]:
            if isinstance(item, dict):
                item.pop("optimizer", None)
    return checkpoint


def load_from_safe_local(filename: str, map_location: Any = None) -> Any:
    """mmengine's local-file checkpoint loader, replaced: cat's safe loader with mmengine's globals,
    then :func:`sanitize_mm_checkpoint`."""
    path = os.path.expanduser(filename)
    if not os.path.isfile(path):  # what stock mmengine raises, word for word
        raise FileNotFoundError(f"{filename} can not be found.")
    checkpoint = load_checkpoint_file(path, map_location or "cpu", safe_globals=mmengine_safe_globals())
    refuse_object_arrays(checkpoint, path)
    return sanitize_mm_checkpoint(checkpoint, path)


def refuse_object_arrays(checkpoint: Any, path: str) -> None:
    """An UnsafeCheckpointError where anything loaded holds a numpy array (or dtype) of Python objects. The reader
    refuses the reconstruction such an array pickles as, but numpy's allowed constructors can also make one (an
    ``ndarray`` of an object ``dtype``): whatever it holds came through the allow-list, yet an object array is no
    data a checkpoint carries, and mmengine's code would take it as such."""
    pending = [checkpoint]
    while pending:
        item = pending.pop()
        if isinstance(item, (np.ndarray, np.generic, np.dtype)) and (
            item.hasobject if isinstance(item, np.dtype) else item.dtype.hasobject
        ):
            raise UnsafeCheckpointError(f"checkpoint {path}: holds a numpy array of Python objects (dtype object)")
        if isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending += list(item)
        elif not isinstance(item, (torch.Tensor, np.ndarray, str, bytes)) and hasattr(item, "__dict__"):
            pending += list(vars(item).values())  # the message hub's HistoryBuffers


def load_from_safe_remote(filename: str, map_location: Any = None) -> Any:
    """mmengine's URL and model-zoo schemes, replaced: fetch (or find in the cache), check the hash a
    torch.hub-style name declares, then read it like a local file."""
    checkpoint = load_from_safe_local(local_checkpoint(filename), map_location)
    if filename.startswith("mmcls://"):
        from mmengine.runner.checkpoint import _process_mmcls_checkpoint

        checkpoint = _process_mmcls_checkpoint(checkpoint)
    return checkpoint


LAST_CHECKPOINT = "last_checkpoint"  # mmengine's pointer, in a run folder, to the checkpoint a run resumes from


def check_last_checkpoint(folder: str) -> None:
    """Before mmengine's auto-resume reads it: ``folder/last_checkpoint`` (if any) must name a
    checkpoint file inside ``folder``, never a URL, another folder or garbage (CheckpointError)."""
    pointer = os.path.join(folder, LAST_CHECKPOINT)
    if not os.path.lexists(pointer):
        return
    try:
        with open(pointer, "rb") as f:
            target = f.read(4097).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"cannot read {pointer} ({error}); delete it to start the run over") from None
    inside = os.path.realpath(os.path.dirname(target)) == os.path.realpath(folder) if target else False
    if "://" in target or len(target) > 4096 or not inside or not os.path.isfile(target):
        raise CheckpointError(
            f"{pointer} names {target[:200]!r}, not a checkpoint file in this run folder; write the path of "
            "one of its iter_N.pth/epoch_N.pth there, or delete it to start the run over"
        )


def check_weights_match(model: torch.nn.Module, filename: str) -> None:
    """Before an evaluation, or a training run that starts from ``filename``: its weights (read as mmengine
    will read them) cover ``model`` exactly, else :class:`cat.models.CheckpointMismatchError` with the report
    of what does not match (mmengine itself loads non-strictly, warns, and evaluates a partly random model,
    or trains one from its initialisation)."""
    from mmengine.model import BaseTTAModel, is_model_wrapper
    from mmengine.runner.checkpoint import CheckpointLoader

    from .backbone import TimmBackbone

    checkpoint = CheckpointLoader.load_checkpoint(filename, map_location="cpu")
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else checkpoint
    state = extract_state_dict(state, filename)
    while is_model_wrapper(model) or isinstance(model, BaseTTAModel):  # mmengine loads into the wrapped model
        model = cast(torch.nn.Module, model.module)
    own = model.state_dict()
    report = LoadReport.between(own, state)
    if not report.clean:
        # A classification checkpoint holds the backbone's own names (most of its keys are found under it).
        backbones = [f"{name}.model." for name, module in model.named_modules() if isinstance(module, TimmBackbone)]
        found = sum(any(prefix + key in own for prefix in backbones) for key in report.unexpected)
        hint = (
            "it holds a classification model's weights: a backbone takes those from model.pretrained="
            if report.unexpected and 2 * found >= len(report.unexpected)
            else None
        )
        raise CheckpointMismatchError(report, filename, hint)


def _refuse_scheme(prefix: str) -> Callable[..., Any]:
    def refuse(filename: str, map_location: Any = None) -> Any:
        raise CheckpointError(
            f"checkpoint {filename}: cat does not read the {prefix} scheme (it cannot check what it "
            "loads); copy the file to local disk and pass its path"
        )

    return refuse


def register_atomic_backend() -> None:
    """Register the atomic file backend (``backend_args={'backend': ATOMIC_BACKEND}``) under its own name: a name
    added, nothing of mmengine's changed (what ``import cat.mm`` does)."""
    from mmengine.fileio import LocalBackend, register_backend

    class AtomicLocalBackend(LocalBackend):
        """mmengine's local backend, with writes that leave the old file or the whole new one."""

        def put(self, obj: bytes, filepath: Any) -> None:
            os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
            atomic_write_bytes(str(filepath), obj)

        def put_text(self, obj: str, filepath: Any, encoding: str = "utf-8") -> None:
            self.put(obj.encode(encoding), filepath)

    register_backend(ATOMIC_BACKEND, AtomicLocalBackend, force=True)


def install_safe_checkpoint_io() -> None:
    """In cat's own runs: route every mmengine checkpoint read through :func:`load_from_safe_local` (local) or
    :func:`load_from_safe_remote` (URLs and model zoos), refuse the other schemes, and register the atomic file
    backend for its writes. Not done by ``import cat.mm``: an import adds names, and a stock tool that imports cat's
    components keeps mmengine's own loading (torch's weights-only reader; cat's checkpoints are written for it)."""
    from mmengine.runner.checkpoint import CheckpointLoader

    register_atomic_backend()
    # mmengine logs "Loads checkpoint by <the loader's name after 'load_from_'> backend": "safe_local", "safe_remote".
    CheckpointLoader.register_scheme(prefixes="", loader=load_from_safe_local, force=True)
    CheckpointLoader.register_scheme(prefixes=REMOTE_PREFIXES, loader=load_from_safe_remote, force=True)
    # Every other scheme mmengine (or a plugin) registered, e.g. pavi:// and s3://, reads through
    # code cat cannot vouch for: refused by name. The table is private; a test checks the result.
    for prefix in list(CheckpointLoader._schemes):
        if prefix not in ("", *REMOTE_PREFIXES):
            CheckpointLoader.register_scheme(prefixes=prefix, loader=_refuse_scheme(prefix), force=True)
