"""The one checkpoint loader of cat: release format, bare state dicts, cat's and mmengine's files.

Nothing here unpickles code. Every file is first read with ``torch.load(weights_only=True)``,
with :data:`DATA_GLOBALS` and at most a caller's narrow allow-list, scoped to that one call (never a
process-wide entry).
Released checkpoints hold a pickled yacs ``CfgNode``, which the weights-only unpickler refuses (it
will not SETITEMS on a dict subclass); those go through :class:`RestrictedUnpickler`, whose
allow-list holds only tensor rebuilding, plain containers, a dict stand-in for ``CfgNode`` and the
data classes of :data:`DATA_GLOBALS`,
and which reads every pickle of the file itself (torch's legacy format included), so no byte of
an untrusted file reaches ``pickle.load``. Every failure names the file.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from cat.errors import CheckpointError, UserError

__all__ = [
    "register_state_dict_adapter",
    "adapt_state_dict",
    "without_classifier",
    "load_pretrained_file",
    "load_for_fine_tuning",
    "check_name_hash",
    "load_checkpoint_file",
    "extract_state_dict",
    "holds_ema_weights",
    "load_state_dict",
    "CheckpointMismatchError",
    "LoadReport",
    "UnsafeCheckpointError",
    "DATA_GLOBALS",
]

# Plain data classes trainers pickle beside the weights, allowed in every weights-only read: timm's train.py saves
# its arguments (``args``) as an argparse.Namespace, a bag of attributes whose unpickling runs none of its code (no
# __setstate__, no __init__) and whose attribute values pass the same allow-list.
DATA_GLOBALS: tuple[type, ...] = (argparse.Namespace,)


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The checkpoint references a Python global outside the allow-list."""


class CfgNodeStandIn(dict):
    """What a pickled yacs ``CfgNode`` loads as: a plain dict of its entries (yacs not needed)."""


def _no_hooks(hooks: Any, metadata: Any = None) -> None:
    # Tensors and parameters carry backward hooks and attribute state; a weights file has neither.
    if hooks or metadata:
        raise UnsafeCheckpointError("a tensor in the file carries backward hooks or attribute state")


def _rebuild_tensor(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    _no_hooks(hooks, metadata)
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, collections.OrderedDict())


def _rebuild_parameter(data, requires_grad, hooks):
    _no_hooks(hooks)
    return torch._utils._rebuild_parameter(data, requires_grad, collections.OrderedDict())


_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("__builtin__", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch", "Size"): torch.Size,
    ("yacs.config", "CfgNode"): CfgNodeStandIn,
    **{(data.__module__, data.__qualname__): data for data in DATA_GLOBALS},
}


# What BUILD (pickle's "set attributes on the object just made") may set, per type: the module
# version table torch attaches to a state dict, the bookkeeping fields of a yacs CfgNode, and any
# attribute of a data class (DATA_GLOBALS: None), whose instances are bags of attributes.
_BUILD_ATTRIBUTES: dict[type, frozenset[str] | None] = {
    collections.OrderedDict: frozenset({"_metadata"}),
    CfgNodeStandIn: frozenset({"__immutable__", "__deprecated_keys__", "__renamed_keys__", "__new_allowed__"}),
    **dict.fromkeys(DATA_GLOBALS),
}


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickler that resolves only the globals a released checkpoint needs, and BUILDs only plain
    instance state onto the containers that legitimately carry some.

    It is pickle's Python unpickler (the C one has no per-opcode hook): the pickles it reads hold the
    structure only, the tensor bytes are stored beside them, so its speed does not matter.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            if module.partition(".")[0] == "mmengine":  # cat's own detection and segmentation checkpoints hold some
                advice = (
                    "mmengine's classes are in the checkpoints of train_det.py and train_seg.py (a whole detector or "
                    "segmentor), which those trainers read"
                )
            else:
                advice = "re-save the file as a plain state dict if you trust it"
            raise UnsafeCheckpointError(
                f"refused global '{module}.{name}': not on cat's checkpoint allow-list (tensors, plain "
                f"containers, yacs CfgNode and argparse.Namespace); {advice}"
            ) from None

    def load_build(self) -> None:
        # pickle's own BUILD would call the target's __setstate__ or setattr() any name onto it,
        # including onto an allow-listed class or function (a process-wide change) or a tensor's
        # hook fields. Here: a dict of known attribute names, onto an instance of a known container.
        state = self.stack.pop()  # type: ignore[attr-defined]  # pickle's pure-Python unpickler: untyped internals
        target = self.stack[-1]  # type: ignore[attr-defined]
        known = type(target) in _BUILD_ATTRIBUTES
        allowed = _BUILD_ATTRIBUTES.get(type(target))
        names = isinstance(state, dict) and all(isinstance(name, str) for name in state)
        if not (known and names and (allowed is None or set(state) <= allowed)):
            what = f"the class {target.__qualname__}" if isinstance(target, type) else f"a {type(target).__name__}"
            fields = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise UnsafeCheckpointError(f"refused BUILD on {what} (state {fields}): a weights file sets no such state")
        target.__dict__.update(state)

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]  # its table, typed for its own methods


class _RestrictedPickleModule:
    """The ``pickle_module`` torch.load uses for the restricted path: every pickle it reads, the
    legacy format's header records included, goes through :class:`RestrictedUnpickler`."""

    Unpickler = RestrictedUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return RestrictedUnpickler(file, **kwargs).load()


def load_checkpoint_file(
    path: str | os.PathLike[str], map_location: str | torch.device = "cpu", safe_globals: Iterable[Any] = ()
) -> Any:
    """Read a checkpoint file without running code from it (see the module docstring).

    ``safe_globals`` widens torch's weights-only allow-list (beyond :data:`DATA_GLOBALS`) for this call only
    (e.g. the numpy reconstructors an mmengine checkpoint needs). Raises :class:`UnsafeCheckpointError` naming the
    file and the refused global, or :class:`CheckpointError` for a missing, empty or corrupt file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    if _file_format(path) == "safetensors":
        return _load_safetensors(path, map_location)
    try:
        with torch.serialization.safe_globals([*DATA_GLOBALS, *safe_globals]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as refused:
        weights_only_error = refused  # typically a released checkpoint's yacs CfgNode
    except Exception as error:  # truncated zip, wrong magic number, I/O error: corrupt, not hostile
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}: {error})") from None
    try:
        return torch.load(path, map_location=map_location, weights_only=False, pickle_module=_RestrictedPickleModule)
    except UnsafeCheckpointError as error:
        # The restricted reader (made for release files) does not know this call's ``safe_globals``: where it
        # refused one of those, the global the file really needs beyond them is the weights-only reader's.
        reason = str(error)
        restricted = re.search(r"refused global '([\w.]+)'", reason)
        named = _REFUSED_GLOBAL.search(str(weights_only_error))
        if restricted and named and restricted.group(1) in _global_names(safe_globals):
            reason = f"refused global '{named.group(1) or named.group(2)}'"
        raise UnsafeCheckpointError(f"refusing to load checkpoint {path}: {reason}") from None
    except UserError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(error).__name__}: {error}; the "
            f"weights-only reader said: {_weights_only_reason(weights_only_error)})"
        ) from None


# torch.save writes a zip archive; its legacy format (and a bare pickle) begins with pickle's PROTO
# opcode; torch.load still reads the tar archives of its first releases ("ustar" at byte 257).
_ZIP_MAGIC, _PICKLE_PROTO, _TAR_MAGIC = b"PK\x03\x04", b"\x80", (257, b"ustar")


def _file_format(path: str) -> str:
    """'torch' (what torch.load reads) or 'safetensors' (timm's and the Hugging Face hub's weights: an
    8-byte header length, then the header's JSON); a CheckpointError for anything else (a web page
    saved in place of a download, a text file), before a reader guesses at its bytes."""
    with open(path, "rb") as file:
        head = file.read(_TAR_MAGIC[0] + len(_TAR_MAGIC[1]))
    if head.startswith((_ZIP_MAGIC, _PICKLE_PROTO)) or head[_TAR_MAGIC[0] :] == _TAR_MAGIC[1]:
        return "torch"
    if head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= os.path.getsize(path) - 8:
        return "safetensors"
    web_page = head.lstrip().lower().startswith((b"<!doctype html", b"<html"))
    raise CheckpointError(
        f"checkpoint {path} is not a PyTorch checkpoint: neither a zip archive, a pickle nor safetensors, it "
        f"begins {head[:40]!r}"
        + ("; it is a web page, saved in place of the file: download the file itself" if web_page else "")
    )


def _load_safetensors(path: str, map_location: str | torch.device) -> dict[str, Tensor]:
    """A safetensors file's tensors (the format holds tensors and a string table only: no code), whatever
    its name and torch's version (a recent torch.load reads them, and only by the name's suffix)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device=str(map_location))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"checkpoint {path} is unreadable (safetensors: {error})") from None


# How torch's weights-only reader names what it refused: a global to look up, or a class it was asked to build.
def _global_names(safe_globals: Iterable[Any]) -> set[str]:
    """The ``module.name`` of each allowed global (an entry may be ``(object, name)``, as torch takes them)."""
    return {
        entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}" for entry in safe_globals
    }


_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)|but got <class '([\w.]+)'>")


def _weights_only_reason(error: BaseException) -> str:
    """What torch's weights-only reader found, without its advice to load with weights_only=False."""
    text = str(error)
    detail = text.partition("WeightsUnpickler error:")[2].strip()
    return (detail or text.strip()).splitlines()[0]


# torch.hub's convention: a file name may end in "-<first hex digits of its sha256>" before the suffix.
_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.")


def check_name_hash(path: str | os.PathLike[str]) -> None:
    """Refuse a file whose name declares a sha256 prefix (torch.hub's ``name-<hash>.pth``) that its
    contents do not have: a corrupt or substituted download. Names without a hash pass."""
    declared = _HASH_IN_NAME.search(os.path.basename(path))
    if declared is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    actual = digest.hexdigest()
    if not actual.startswith(declared.group(1)):
        raise CheckpointError(
            f"checkpoint {path} fails its hash check: the name declares sha256 {declared.group(1)}..., the "
            f"contents hash to {actual[: len(declared.group(1))]}...; the file is corrupt or not the one "
            "published: delete it and download it again"
        )


# Where a checkpoint keeps the weight EMA: cat's and DeiT's name, timm's train.py's, cat's own before it wrote the
# first (the EMA wrapper's state dict, its names under "module.").
EMA_KEYS = ("model_ema", "state_dict_ema", "ema")


def holds_ema_weights(checkpoint: Any) -> bool:
    """Whether a loaded checkpoint holds a weight EMA beside the model (a run with ``ema.enabled=true``)."""
    return isinstance(checkpoint, dict) and any(isinstance(checkpoint.get(key), dict) for key in EMA_KEYS)


def extract_state_dict(checkpoint: Any, source: str = "checkpoint", use_ema: bool = False) -> dict[str, Tensor]:
    """The model state dict inside a loaded checkpoint (release format, mmengine format or bare), or with
    ``use_ema`` its weight EMA; a CheckpointError naming ``source`` (the file it was read from) when there is none."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{source} holds a {type(checkpoint).__name__}, not a checkpoint (a dict of weights)")
    if use_ema and not holds_ema_weights(checkpoint):
        raise CheckpointError(
            f"{source} holds no weight EMA (no {', '.join(EMA_KEYS)} entry): its run did not keep one (ema.enabled)"
        )
    for key in EMA_KEYS if use_ema else ("model", "state_dict"):
        if isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
            break
    non_tensors = [str(k) for k, v in checkpoint.items() if not isinstance(v, Tensor)]
    if non_tensors:
        raise CheckpointError(
            f"{source} holds no 'model' or 'state_dict' entry and is not a bare state dict; "
            f"non-tensor entries: {', '.join(non_tensors[:10])}"
        )
    # Weights saved from a DistributedDataParallel or torch.compile wrapper carry a prefix.
    for prefix in ("module.", "_orig_mod."):
        if checkpoint and all(k.startswith(prefix) for k in checkpoint):
            checkpoint = {k[len(prefix) :]: v for k, v in checkpoint.items()}
    return dict(checkpoint)


@dataclass
class LoadReport:
    """What did not load: keys the model lacks, keys the checkpoint lacks, and shape conflicts."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatch: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @classmethod
    def between(cls, own: dict[str, Tensor], state_dict: dict[str, Tensor]) -> LoadReport:
        """What of ``state_dict`` would not load into a model whose state dict is ``own``."""
        return cls(
            missing=[k for k in own if k not in state_dict],
            unexpected=[k for k in state_dict if k not in own],
            shape_mismatch=[
                (k, tuple(own[k].shape), tuple(v.shape))
                for k, v in state_dict.items()
                if k in own and own[k].shape != v.shape
            ],
        )

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatch)

    def __str__(self) -> str:
        lines = []
        if self.missing:
            lines.append(f"missing in checkpoint ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"unexpected in checkpoint ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        for key, want, got in self.shape_mismatch:
            lines.append(f"shape mismatch {key}: model {want}, checkpoint {got}")
        return "\n".join(lines) or "all keys matched"


class CheckpointMismatchError(UserError, ValueError):
    """The checkpoint's keys or shapes do not match the model (``strict=True``)."""

    def __init__(self, report: LoadReport, source: str, hint: str | None = None) -> None:
        self.report = report
        advice = hint or "strict=False, or strict_load=false for a trainer, loads the matching part"
        super().__init__(f"checkpoint {source} does not match the model ({advice}):\n{report}")


def load_state_dict(
    model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True, source: str = "state dict"
) -> LoadReport:
    """Load ``state_dict`` into ``model``; with ``strict`` raise on any mismatch, else load what fits."""
    own = model.state_dict()
    report = LoadReport.between(own, state_dict)
    if strict and not report.clean:
        raise CheckpointMismatchError(report, source)
    bad = {k for k, _, _ in report.shape_mismatch}
    model.load_state_dict({k: v for k, v in state_dict.items() if k in own and k not in bad}, strict=False)
    return report


_logger = logging.getLogger(__name__)

# Per-family fixes for weights trained at another resolution (position embeddings resampled, Swin's
# relative-position tables resized), registered by each family's module for its model class.
Model = TypeVar("Model", bound=nn.Module)
# Each adapter with the class whose models (an instance of it) it takes.
_STATE_DICT_ADAPTERS: list[tuple[type, Callable[[dict[str, Tensor], Any], dict[str, Tensor]]]] = []


def register_state_dict_adapter(
    cls: type[Model], adapter: Callable[[dict[str, Tensor], Model], dict[str, Tensor]]
) -> None:
    """``adapter(state_dict, model)`` fits checkpoints to models of ``cls`` (and its subclasses)."""
    _STATE_DICT_ADAPTERS.append((cls, adapter))


def adapt_state_dict(model: nn.Module, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` with resolution-dependent tensors resized to fit ``model``."""
    for cls, adapter in _STATE_DICT_ADAPTERS:
        if isinstance(model, cls):
            return adapter(state_dict, model)
    return state_dict


def without_classifier(model: nn.Module, state_dict: dict[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """``state_dict`` less its classifier entries, and the classifier's name."""
    classifier = getattr(model, "pretrained_cfg", {}).get("classifier", "head")
    return {k: v for k, v in state_dict.items() if not k.startswith(f"{classifier}.")}, classifier


def load_pretrained_file(model: nn.Module, path: str | os.PathLike[str]) -> LoadReport:
    """timm's ``load_pretrained`` hook (``custom_load`` configs): a release file, downloaded by timm
    into its cache or given as ``pretrained_cfg_overlay=dict(file=...)``, read by the safe loader after
    its name's hash is checked. Everything must match except a classifier of another class count
    (``num_classes=``), which keeps its fresh initialisation."""
    check_name_hash(path)
    return load_for_fine_tuning(model, extract_state_dict(load_checkpoint_file(path), str(path)), True, str(path))


def load_for_fine_tuning(
    model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True, source: str = "state dict"
) -> LoadReport:
    """Load ``state_dict`` (fitted to the model's resolution) into ``model``, except a classifier shaped
    for another class count, which keeps its fresh initialisation: fine-tuning on other data, as timm's
    pretrained weights and the authors' ``--finetune`` do. With ``strict`` any other mismatch raises."""
    state_dict = adapt_state_dict(model, state_dict)
    own = model.state_dict()
    kept, classifier = without_classifier(model, state_dict)
    other = {
        k: tuple(v.shape) for k, v in state_dict.items() if k not in kept and (k not in own or own[k].shape != v.shape)
    }
    if other:
        _logger.info(
            "%s: classifier %r not loaded (another class count: %s); it starts from its fresh initialisation",
            source,
            classifier,
            ", ".join(f"{k} {shape}" for k, shape in other.items()),
        )
        state_dict = kept
    report = LoadReport.between(own, state_dict)
    if other:
        report.missing = [k for k in report.missing if not k.startswith(f"{classifier}.")]
    if strict and not report.clean:
        raise CheckpointMismatchError(report, source)  # before any weight is loaded, as load_state_dict's
    load_state_dict(model, state_dict, strict=False, source=source)
    return report
