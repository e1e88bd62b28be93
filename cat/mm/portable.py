"""Checkpoints any stock OpenMMLab tool loads: what mmengine's message hub keeps, written as plain data.

mmengine saves its message hub's ``log_scalars`` as ``HistoryBuffer`` objects (numpy arrays inside, and its
statistics methods pickled through ``builtins.getattr``), so torch's ``weights_only`` loader, the default of
``torch.load`` since torch 2.6 and what stock mmengine calls, refuses every checkpoint mmengine writes.
:class:`PortableCheckpointHook` writes them as plain numbers and lists instead (and numpy numbers elsewhere in the
hub as Python numbers): the file then loads in a bare ``torch.load``, in stock ``tools/test.py`` and anywhere else.
:func:`restore_message_hub` turns the plain buffers back into ``HistoryBuffer`` objects when cat's loader reads the
file (``import cat.mm``), so a resume keeps its smoothing windows; stock mmengine skips them with a warning.
"""

from __future__ import annotations

import json
import numbers
from typing import Any, TypeGuard

import numpy as np
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer
from mmengine.registry import HOOKS

__all__ = ["PLAIN_BUFFER_KEYS", "PortableCheckpointHook", "RunConfigHook", "plain_message_hub", "restore_message_hub"]

PLAIN_BUFFER_KEYS = frozenset({"log_history", "count_history", "max_length"})


def _plain(value: Any) -> Any:
    """``value`` with numpy numbers and arrays as Python numbers and lists, containers rebuilt (never mutated)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return type(value)((k, _plain(v)) for k, v in value.items())  # OrderedDict stays one
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def plain_message_hub(hub: dict[str, Any]) -> dict[str, Any]:
    """A message hub's ``state_dict`` as plain data: each ``HistoryBuffer`` as a dict of
    :data:`PLAIN_BUFFER_KEYS`, numpy values as Python ones."""
    scalars = {
        key: (
            {
                "log_history": buffer._log_history.tolist(),
                "count_history": buffer._count_history.tolist(),
                "max_length": int(buffer.max_length),
            }
            if isinstance(buffer, HistoryBuffer)
            else _plain(buffer)
        )
        for key, buffer in hub.get("log_scalars", {}).items()
    }
    return {**{k: _plain(v) for k, v in hub.items() if k != "log_scalars"}, "log_scalars": scalars}


def _numbers(values: Any) -> TypeGuard[list[numbers.Real]]:
    return isinstance(values, list) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values)


def restore_message_hub(hub: Any) -> Any:
    """The plain buffers of a hub :func:`plain_message_hub` wrote, as ``HistoryBuffer`` objects again; an entry
    that is not such a buffer (lists of numbers of one length, a positive ``max_length``) is dropped, as mmengine
    drops what is not a HistoryBuffer."""
    scalars = hub.get("log_scalars") if isinstance(hub, dict) else None
    if not isinstance(scalars, dict):
        return hub
    for key, value in list(scalars.items()):
        if isinstance(value, HistoryBuffer) or not isinstance(value, dict):
            continue
        log, count, length = (value.get(k) for k in ("log_history", "count_history", "max_length"))
        if (
            value.keys() == PLAIN_BUFFER_KEYS
            and _numbers(log)
            and _numbers(count)
            and len(log) == len(count)
            and type(length) is int
            and length >= 1
        ):
            scalars[key] = HistoryBuffer(log, count, length)
        else:
            del scalars[key]
    return hub


@HOOKS.register_module(force=True)
class PortableCheckpointHook(Hook):
    """Writes the message hub into each checkpoint as plain data (:func:`plain_message_hub`), so the file loads
    with torch's ``weights_only`` loader: in stock mmengine, a bare ``torch.load``, any tool."""

    priority = "VERY_LOW"  # after any hook that adds to the checkpoint

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if isinstance(checkpoint.get("message_hub"), dict):
            checkpoint["message_hub"] = plain_message_hub(checkpoint["message_hub"])


@HOOKS.register_module(force=True)
class RunConfigHook(Hook):
    """Writes the run's config record (cat's, as ``config.yaml`` holds it) into each checkpoint under ``config``, as
    classification's checkpoints carry theirs: a resume compares against the config the weights were trained with
    (:func:`cat.runtime.resume.check_resume`), wherever the file has moved."""

    def __init__(self, config: dict[str, Any]) -> None:
        # As plain data: the Runner hands its hooks' arguments over as ConfigDicts, which torch's weights-only
        # loader (stock tools, a bare torch.load) refuses to unpickle.
        self.config = json.loads(json.dumps(config))

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint["config"] = self.config
