"""What Hydra asks cat while it composes a config: ``--help``'s list of a job's documented keys with their composed
values (``${cat_keys:...}`` in ``job.yaml``), and the keys a sweep cell's folder name leaves out
(``${cat_unnamed_keys:...}`` in each trainer's config). The resolvers are registered as this module is imported
(``import cat.runtime`` does)."""

from __future__ import annotations

import functools

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from .schema import run_name_excluded, schema_keys, schema_of

__all__ = ["schema_help", "unnamed_keys"]

_NOT_SET = object()


def schema_help(schema: type, cfg: DictConfig | None = None) -> str:
    """The documented keys, one per line: ``key: type — doc [now: value]``."""
    lines = []
    for path, expected, doc in schema_keys(schema):
        now = ""
        if cfg is not None:
            value = OmegaConf.select(cfg, path, default=_NOT_SET, throw_on_resolution_failure=False)
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value)
            now = "  [not set in this config]" if value is _NOT_SET else f"  [{value!r}]"
        lines.append(f"  {path}: {expected} -- {doc}{now}")
    return "\n".join(lines)


_help_in_progress: list[bool] = []  # the help reads every key's value: one that names this resolver is not re-entered


def _help_resolver(job_name: str, *, _root_: DictConfig) -> str:
    if _help_in_progress:  # ${cat_keys:...} in a key's value (name=${cat_keys:train_cls}) recursed without end
        return "<--help>"
    _help_in_progress.append(True)
    try:
        return schema_help(schema_of(job_name.removeprefix("train_")), _root_)
    finally:
        _help_in_progress.pop()


@functools.cache
def _unnamed_keys(schema: type) -> tuple[str, ...]:
    return (*run_name_excluded(schema), "sweep")


def unnamed_keys(schema: type) -> list[str]:
    """What a sweep cell's folder name leaves out of its overrides: the keys declared ``in_run_name=False``, and
    ``sweep``, the config group that picks a sweep preset (no key, and no more a cell's name). Hydra asks at
    every composition: computed once per schema."""
    return list(_unnamed_keys(schema))


def _unnamed_keys_resolver(schema_path: str) -> list[str]:
    return unnamed_keys(get_class(schema_path))


# ``${cat_keys:${hydra.job.name}}`` in job.yaml's ``hydra.help.template``: ``python train_cls.py
# --help`` lists the documented keys of ``schema/cls`` with their composed values.
if not OmegaConf.has_resolver("cat_keys"):
    OmegaConf.register_new_resolver("cat_keys", _help_resolver)
# ``${cat_unnamed_keys:cat.classification.schema.ClsConfig}`` in a trainer's config: the keys its sweep cells'
# folder names leave out. The config names its schema's class, which Hydra composes before anything imports it.
if not OmegaConf.has_resolver("cat_unnamed_keys"):
    OmegaConf.register_new_resolver("cat_unnamed_keys", _unnamed_keys_resolver)
