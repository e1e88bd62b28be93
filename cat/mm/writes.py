"""Where a detection or segmentation run's mmengine components will write, resolved from the runner's final config
before the runner is built, and refused where it lands outside the run folder.

Every hook (``default_hooks``, ``custom_hooks``), the visualizer, its backends and the evaluators' metrics is looked
up in the registries as the runner will build it. Its options are checked against what its class accepts (a misspelt
``intervall`` ends here, not in mmengine's ``TypeError`` one interval into training), and each place it writes is
resolved as mmengine resolves it: templates filled in (``filename_tmpl``), ``out_dir`` joined with the run folder's
name, a visualisation folder joined under the run's log folder, a relative path from the working directory. A
component cat cannot place (another visualisation backend, a hook of its own) is refused where it is given a path.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["write_problems"]

# A placeholder for the timestamp of the run's log folder (work_dir/<timestamp>/): any name inside the folder.
_STAMP = "00000000_000000"
# The options naming where a component writes, for a component whose places cat does not know (their names only
# find candidates: each value is then resolved and checked as a path).
_PATH_WORDS = ("dir", "path", "file", "tmpl", "uri", "location", "prefix")


_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _is_path_option(name: str, value: Any) -> bool:
    """Whether an option of a component cat does not know names a place on this machine: a path, or a ``file://``
    URI (another scheme, a tracking server's ``http://``, is not a path)."""
    if not isinstance(value, (str, os.PathLike)) or not any(word in name for word in _PATH_WORDS):
        return False
    scheme = _URI.match(os.fspath(value))
    return scheme is None or scheme.group(1).lower() == "file"


def _path(value: Any, option: str) -> str:
    """An option's value as a path (a ``file://`` URI's path), or _NotPlaced naming what it is instead."""
    if not isinstance(value, (str, os.PathLike)):
        raise _NotPlaced(f"{option} must be a path (a string); got {type(value).__name__} {value!r}")
    path = os.fspath(value)
    if (scheme := _URI.match(path)) is not None and scheme.group(1).lower() == "file":
        return path[len(scheme.group(0)) :]
    return path


class _Component:
    """One component of the config: where it sits (``mm.custom_hooks[0]``), its options, and its class."""

    def __init__(self, where: str, options: dict[str, Any], cls: type) -> None:
        self.where, self.options, self.cls = where, options, cls
        self.parameters = inspect.signature(cls).parameters  # its __init__'s, less self

    def option(self, name: str) -> Any:
        """The value the component gets for ``name``: given, else its class's default (None where it has none)."""
        if name in self.options:
            return self.options[name]
        parameter = self.parameters.get(name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _joined(base: str, path: Any) -> str:
    """``path`` as ``os.path.join`` places it under ``base`` (an absolute one stays where it is)."""
    return os.path.join(base, _path(path, "a path"))


def _checkpoint_hook(hook: _Component, work_dir: str, log_dir: str) -> Iterator[tuple[str, str]]:
    out_dir = hook.option("out_dir")
    # mmengine: out_dir, when given, is joined with the run folder's own name.
    run_name = os.path.basename(work_dir.rstrip(os.sep))
    base = work_dir if out_dir is None else _joined(_path(out_dir, "out_dir"), run_name)
    yield "out_dir", base
    template = hook.option("filename_tmpl") or "epoch_{}.pth"
    try:
        name = template.format(1)
    except (IndexError, KeyError, ValueError, AttributeError):
        raise _NotPlaced(f"{template!r} is not a checkpoint name with one {{}} for the epoch or iteration") from None
    yield "filename_tmpl", _joined(base, name)


def _logger_hook(hook: _Component, work_dir: str, log_dir: str) -> Iterator[tuple[str, str]]:
    if (out_dir := hook.option("out_dir")) is not None:
        yield "out_dir", _joined(_path(out_dir, "out_dir"), os.path.basename(work_dir.rstrip(os.sep)))


def _profiler_hook(hook: _Component, work_dir: str, log_dir: str) -> Iterator[tuple[str, str]]:
    if (trace := hook.option("json_trace_path")) is not None:
        yield "json_trace_path", _path(trace, "json_trace_path")
    ready = hook.option("on_trace_ready")
    if isinstance(ready, dict) and ready.get("dir_name") is not None:
        yield "on_trace_ready.dir_name", _joined(log_dir, ready["dir_name"])


def _visualization_hook(hook: _Component, work_dir: str, log_dir: str) -> Iterator[tuple[str, str]]:
    if (out := hook.option("test_out_dir")) is not None:  # mmdet joins it under work_dir/<timestamp>/
        yield "test_out_dir", _joined(log_dir, out)


def _local_backend(backend: _Component, save_dir: str) -> Iterator[tuple[str, str]]:
    yield "save_dir", save_dir
    for option in ("img_save_dir", "config_save_file", "scalar_save_file"):
        yield option, _joined(save_dir, backend.option(option))


# Where each hook cat knows writes, from its options and the run's folders (work_dir, its log folder).
_HOOK_PLACES: dict[str, Callable[[_Component, str, str], Iterator[tuple[str, str]]]] = {
    "CheckpointHook": _checkpoint_hook,
    "LoggerHook": _logger_hook,
    "ProfilerHook": _profiler_hook,
    "DetVisualizationHook": _visualization_hook,
    "TrackVisualizationHook": _visualization_hook,
    "GroundingVisualizationHook": _visualization_hook,
}
# The metrics' options naming files or folders they write (relative ones from the working directory).
# collect_dir: where ranks gather their results on the CPU, which mmengine deletes afterwards.
_METRIC_OUTPUTS = ("outfile_prefix", "output_dir", "out_file_path", "jsonfile_prefix", "collect_dir")


class _NotPlaced(ValueError):
    """An option whose value says no place cat can resolve."""


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _build_class(registry: Any, spec: Any, where: str, problems: list[str]) -> type | None:
    kind = spec.get("type") if isinstance(spec, dict) else None
    if isinstance(kind, type):
        return kind
    cls = None
    if isinstance(kind, str):
        with registry.switch_scope_and_registry(None) as scoped:  # the config's default scope, as build() looks
            cls = scoped.get(kind)
    if cls is None:
        problems.append(f"{where}.type={kind!r}: no {registry.name} of that name is registered")
    return cls


# Classes whose **kwargs take nothing more: CheckpointHook hands them to Runner.save_checkpoint beside every one of
# its parameters, so any option it does not name fails there, at the first save.
_KWARGS_TAKE_NONE = frozenset({"CheckpointHook"})
_NOT_OPTIONS = {"type", "priority", "name"}  # taken by the runner or registry, not passed to the class


def _component(registry: Any, spec: Any, where: str, problems: list[str]) -> _Component | None:
    """The component at ``where``, its options checked against its class (None where it cannot be built)."""
    cls = _build_class(registry, spec, where, problems)
    if cls is None or not isinstance(spec, dict):
        return None
    component = _Component(where, {k: v for k, v in spec.items() if k not in _NOT_OPTIONS}, cls)
    takes_any = cls.__name__ not in _KWARGS_TAKE_NONE and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in component.parameters.values()
    )
    accepted = sorted(name for name in component.parameters if name != "self")
    unknown = [] if takes_any else sorted(component.options.keys() - set(accepted))
    problems += [
        f"{where}.{name}: {cls.__name__} takes no option {name!r} (it takes {', '.join(accepted) or 'none'})"
        for name in unknown
    ]
    return None if unknown else component  # one that cannot be built writes nothing


def _place_problems(component: _Component, places: Iterator[tuple[str, str]], run_dir: str) -> list[str]:
    """The first of a component's places outside ``run_dir`` (those after it are most often joined under it)."""
    try:
        for option, path in places:
            if not _inside(path, run_dir):
                return [
                    f"{component.where}.{option}: {component.cls.__name__} would write {path}, outside the run folder "
                    f"{run_dir}; a run writes in its own folder only (choose it with output_dir=)"
                ]
    except _NotPlaced as error:
        return [f"{component.where}: {error}"]
    return []


def _given_paths(component: _Component) -> Iterator[tuple[str, str]]:
    """The path options given to a component cat does not know (relative ones from the working directory)."""
    for name, value in component.options.items():
        if _is_path_option(name, value):
            yield name, _path(value, name)


def _entries(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and "type" in node:
        yield where, node
    elif isinstance(node, (list, tuple)):
        for index, item in enumerate(node):
            yield from _entries(item, f"{where}[{index}]")


def _visualizer_problems(spec: Any, log_dir: str, run_dir: str) -> list[str]:
    """The visualizer's place (by default the run's log folder) and each backend's: its ``save_dir`` defaults to
    ``vis_data`` under the visualizer's, as mmengine's ``Visualizer`` sets it."""
    from mmengine.registry import VISBACKENDS, VISUALIZERS

    problems: list[str] = []
    if not isinstance(spec, dict) or (visualizer := _component(VISUALIZERS, spec, "mm.visualizer", problems)) is None:
        return problems
    try:
        save_dir = _path(visualizer.option("save_dir") or log_dir, "save_dir")
    except _NotPlaced as error:
        return [*problems, f"{visualizer.where}: {error}"]
    if refused := _place_problems(visualizer, iter([("save_dir", save_dir)]), run_dir):
        return refused  # its backends write under it
    vis_data = os.path.join(save_dir, "vis_data")
    backends = spec.get("vis_backends") or []
    if not isinstance(backends, (list, tuple)):
        return [*problems, f"mm.visualizer.vis_backends must be a list of backends; got {type(backends).__name__}"]
    for where, backend_spec in _entries(list(backends), "mm.visualizer.vis_backends"):
        if (backend := _component(VISBACKENDS, backend_spec, where, problems)) is not None:
            problems += _place_problems(backend, _backend_places(backend, vis_data), run_dir)
    return problems


def _backend_places(backend: _Component, vis_data: str) -> Iterator[tuple[str, str]]:
    own = _path(backend.option("save_dir") or vis_data, "save_dir")
    if backend.cls.__name__ == "LocalVisBackend":
        yield from _local_backend(backend, own)
        return
    if "save_dir" in backend.parameters:
        yield "save_dir", own
    yield from _given_paths(backend)
    init_kwargs = backend.option("init_kwargs")  # W&B's wandb.init(dir=...) and the like: where the service writes
    if isinstance(init_kwargs, dict):
        for name, value in init_kwargs.items():
            if name == "dir" or _is_path_option(name, value):
                yield f"init_kwargs.{name}", _path(value, f"init_kwargs.{name}")


def _metric_places(metric: _Component) -> Iterator[tuple[str, str]]:
    for option in _METRIC_OUTPUTS:
        if (value := metric.option(option)) is not None:
            yield option, _path(value, option)
    if metric.cls.__name__ == "DumpProposals":  # mmdet joins proposals_file under output_dir (an absolute one: as is)
        output_dir = _path(metric.option("output_dir") or ".", "output_dir")
        yield "proposals_file", _joined(output_dir, metric.option("proposals_file") or "proposals.pkl")


def _evaluator_metrics(spec: Any) -> Any:
    """An evaluator's metrics: a metric or a list of them, or mmengine's ``{metrics: [...]}`` (with or without the
    ``Evaluator`` type)."""
    if isinstance(spec, dict) and spec.get("type") in (None, "Evaluator") and "metrics" in spec:
        return spec["metrics"]
    return spec


def write_problems(mm: Any, run_dir: str) -> list[str]:
    """What in the runner's final config ``mm`` (its ``default_scope`` registered) writes outside ``run_dir`` or
    takes options its class does not accept, one line each; empty where nothing does."""
    from mmengine.registry import HOOKS, METRICS, DefaultScope

    problems: list[str] = []
    work_dir = os.path.abspath(mm.get("work_dir") or run_dir)
    if not _inside(work_dir, run_dir) or not _inside(run_dir, work_dir):  # everything else would follow it
        return [f"mm.work_dir: mmengine writes in the run folder {run_dir} only; choose it with output_dir="]
    log_dir = os.path.join(work_dir, _STAMP)
    with DefaultScope.overwrite_default_scope(mm.get("default_scope")):
        hooks = [(f"mm.default_hooks.{name}", spec) for name, spec in (mm.get("default_hooks") or {}).items() if spec]
        custom = mm.get("custom_hooks") or []
        if not isinstance(custom, (list, tuple)):
            return [f"mm.custom_hooks must be a list of hooks (dicts with a type); got {type(custom).__name__}"]
        hooks += list(_entries(list(custom), "mm.custom_hooks"))
        for where, spec in hooks:
            if (hook := _component(HOOKS, spec, where, problems)) is not None:
                places = _HOOK_PLACES.get(hook.cls.__name__)
                found = places(hook, work_dir, log_dir) if places else _given_paths(hook)
                problems += _place_problems(hook, found, run_dir)
        problems += _visualizer_problems(mm.get("visualizer"), log_dir, run_dir)
        for section in ("val_evaluator", "test_evaluator"):
            evaluator = mm.get(section)
            metrics = _evaluator_metrics(evaluator)
            for where, spec in _entries(metrics, f"mm.{section}" + (".metrics" if metrics is not evaluator else "")):
                if (metric := _component(METRICS, spec, where, problems)) is not None:
                    problems += _place_problems(metric, _metric_places(metric), run_dir)
    return problems
