"""A component of a detection or segmentation run is a registered name.

mmengine builds each ``dict(type=..., ...)`` of a config through its registries, and a registry handed a dotted
name it does not hold imports the module and takes the attribute: ``type='os.system'`` in a hook runs a shell
command. :func:`type_problems` walks the runner's whole final config before anything is built from it and accepts a
``type`` only where it names what the OpenMMLab registries hold: a registered name (``CheckpointHook``), a scoped one
(``mmdet.CocoMetric``), or a dotted path or class object that is, without importing anything, a registered class
(``mmengine.hooks.CheckpointHook``); and the operators of ``mmcv.ops`` by name, which an RoI extractor's layer and
an NMS config take from that module. A user's own component is registered by its module, imported through mmengine's
``custom_imports`` as its documentation describes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["component_names", "import_custom_modules", "type_problems"]


def _registries() -> Iterator[Any]:
    """Every registry of mmengine's root and its children (mmdet's, mmseg's, mmcv's: whatever is imported)."""
    import mmengine.registry as root

    def walk(registry: Any) -> Iterator[Any]:
        yield registry
        for child in registry.children.values():
            yield from walk(child)

    for value in vars(root).values():
        if isinstance(value, root.Registry):
            yield from walk(value)


def _mmcv_ops() -> set[str]:
    """The operators mmcv's ops module exports: what an RoI extractor's ``roi_layer`` and an ``nms`` config name by
    ``type`` (mmdet takes them from that module by name, mmcv's ``batched_nms`` by evaluating the name)."""
    try:
        import mmcv.ops
    except ImportError:
        return set()
    return {name for name in getattr(mmcv.ops, "__all__", ()) if name.isidentifier()}


def _registered() -> tuple[set[str], set[int]]:
    """The names the registries hold, plain and scoped (and mmcv's operators), and the ids of the objects they
    hold."""
    names: set[str] = _mmcv_ops()
    objects: set[int] = set()
    for registry in _registries():
        registry.import_from_location()  # what a registry would import on its first lookup: its own modules
        for name, obj in registry.module_dict.items():
            names.update((name, f"{registry.scope}.{name}"))
            objects.add(id(obj))
    return names, objects


def _resolves_to_registered(dotted: str, objects: set[int]) -> bool:
    """Whether ``dotted`` (module.attribute) is a registered object of a module already imported."""
    module_name, _, attribute = dotted.rpartition(".")
    module = sys.modules.get(module_name)
    return module is not None and id(getattr(module, attribute, None)) in objects


# Components whose options hold a record (the run's own config, +mm included), not components to build.
_RECORDS = frozenset({"RunConfigHook"})


def _typed(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        if "type" in node:
            yield where, node["type"]
            if node["type"] in _RECORDS:
                return
        for key, value in node.items():
            yield from _typed(value, f"{where}.{key}")
    elif isinstance(node, (list, tuple)):
        for index, item in enumerate(node):
            yield from _typed(item, f"{where}[{index}]")


def type_problems(mm: Any) -> list[str]:
    """One line for each ``type`` in the mmengine config ``mm`` (a Config or dict) that is not a registered name
    or class; empty where every one is."""
    names, objects = _registered()
    problems = []
    for where, kind in _typed(mm.to_dict() if hasattr(mm, "to_dict") else dict(mm), "mm"):
        if isinstance(kind, str):
            if kind in names or ("." in kind and _resolves_to_registered(kind, objects)):
                continue
            shown = repr(kind)
        elif id(kind) in objects:
            continue
        else:
            shown = getattr(kind, "__qualname__", None) or repr(kind)
        problems.append(
            f"{where}.type={shown}: not a component the OpenMMLab registries hold; a config names a registered "
            "class (e.g. CheckpointHook or mmdet.CocoMetric), never an import path (register your own through "
            "custom_imports)"
        )
    return problems


def import_custom_modules(mm: Any) -> None:
    """Import the config's ``custom_imports`` (cat's own, then the user's: what registers their components), as
    mmengine's ``Config.fromfile`` would; ConfigError in one line for one that is not a module name or fails."""
    import importlib

    from cat.errors import ConfigError

    imports = (mm.get("custom_imports") or {}).get("imports") or []
    if not isinstance(imports, (list, tuple)) or not all(isinstance(name, str) for name in imports):
        raise ConfigError(f"mm.custom_imports.imports must be a list of module names; got {imports!r}")
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001  (whatever a user's module raises on import: one line)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ConfigError(f"mm.custom_imports: importing {name} failed ({type(error).__name__}: {first})") from None


def component_names(mm: Any) -> tuple[str, str]:
    """The final hooks (default and custom) and visualizer backends of ``mm``, by type, for the log."""
    hooks = [spec.get("type") for spec in (mm.get("default_hooks") or {}).values() if isinstance(spec, dict)]
    hooks += [spec.get("type") for spec in mm.get("custom_hooks") or [] if isinstance(spec, dict)]
    visualizer = mm.get("visualizer") or {}
    backends = [spec.get("type") for spec in visualizer.get("vis_backends") or [] if isinstance(spec, dict)]
    return ", ".join(map(str, hooks)) or "none", ", ".join(map(str, backends)) or "none"
