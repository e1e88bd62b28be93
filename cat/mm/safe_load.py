"""mmengine's checkpoints through cat's one safe loader, and written atomically.

mmengine 0.10.7 reads checkpoints with a bare ``torch.load`` and writes them with a plain
``open(path, 'wb')``. Its checkpoints hold the message hub's ``HistoryBuffer`` (numpy arrays
inside, and its statistics methods pickled as ``getattr(HistoryBuffer, 'mean')``). So:

- local checkpoints are read by :func:`cat.models.load_checkpoint_file` with exactly those
  globals allowed for that one call. ``builtins.getattr`` itself is never allowed: the name maps to
  :func:`_history_buffer_method`, which resolves HistoryBuffer's statistics methods and nothing
  else (a real ``getattr`` reaches ``builtins.eval`` through ``getattr.__self__``);
- checkpoints and the ``last_checkpoint`` pointer are written through an atomic file backend.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from cat.models import load_checkpoint_file
from cat.runtime.io import atomic_write_bytes

__all__ = ["ATOMIC_BACKEND", "install_safe_checkpoint_io", "load_mm_checkpoint", "mmengine_safe_globals"]

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
        *{type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")},
        (_history_buffer_method, "builtins.getattr"),
    ]


def load_mm_checkpoint(filename: str, map_location: Any = None) -> Any:
    """mmengine's local-file checkpoint loader, replaced: cat's safe loader with mmengine's globals."""
    return load_checkpoint_file(
        os.path.expanduser(filename), map_location or "cpu", safe_globals=mmengine_safe_globals()
    )


def install_safe_checkpoint_io() -> None:
    """Route mmengine's local checkpoint reads through :func:`load_mm_checkpoint`, and register the
    atomic file backend (``backend_args={'backend': ATOMIC_BACKEND}``) for its writes."""
    from mmengine.fileio import LocalBackend, register_backend
    from mmengine.runner.checkpoint import CheckpointLoader

    class AtomicLocalBackend(LocalBackend):
        """mmengine's local backend, with writes that leave the old file or the whole new one."""

        def put(self, obj: bytes, filepath: Any) -> None:
            os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
            atomic_write_bytes(str(filepath), obj)

        def put_text(self, obj: str, filepath: Any, encoding: str = "utf-8") -> None:
            self.put(obj.encode(encoding), filepath)

    CheckpointLoader.register_scheme(prefixes="", loader=load_mm_checkpoint, force=True)
    register_backend(ATOMIC_BACKEND, AtomicLocalBackend, force=True)
