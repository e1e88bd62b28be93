"""The key language of cat's typed configuration: one dataclass per config section, a schema per job
(:func:`register_schema`). The sections every job has are :mod:`cat.runtime.job_config`'s; ``--help`` and the
keys a sweep cell's name leaves out, which Hydra asks for while it composes, are :mod:`cat.runtime.config_help`'s.

A key's value lives in the YAML (``configs/``, ``cat/configs/``); its type (a ``Literal`` for a key with
choices, so the type checker holds the code to them too), its one-line doc, its range and every other fact
about it (what a resume may do with it, whether it names a sweep cell, what a run recorded before it existed
had) live here, next to the field (:func:`key`).
:func:`schema_problems` checks a composed config against its schema and names every problem on one line
each, all at once: types, ranges, choices, keys the schema does not know and keys the config lacks. Cat
checks after Hydra composes rather than putting the schema in Hydra's defaults list, because Hydra stops at
the first mistyped value with a multi-line report and exit status 1, where cat's jobs end with
``error: ...`` and 2. A config that passes becomes the schema's dataclasses (:func:`typed_config`): that
object is what the code reads, each component its own section.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, Union

from omegaconf import MISSING, DictConfig, OmegaConf

if TYPE_CHECKING:  # any section of a typed config
    from _typeshed import DataclassInstance

__all__ = [
    "key",
    "section",
    "FIXED",
    "FREE",
    "RECIPE",
    "GROW",
    "typed_config",
    "typed_section",
    "config_record",
    "config_yaml",
    "key_rule",
    "run_length_key",
    "run_name_excluded",
    "absent_defaults",
    "register_schema",
    "schema_of",
    "schema_problems",
    "mapping_problems",
    "section_keys",
    "unknown_key_problem",
    "schema_keys",
]

_ABSENT = object()
# What a resume may do with a key (:func:`key`'s ``resume``): change it (applied from the resumed step on),
# change it as part of the recipe (applied from the resumed step on; a finished run has no step left for it), grow
# it (the run's length: never below what its checkpoint trained or began), or nothing: a change makes it another
# run, and the resume is refused.
FREE, RECIPE, GROW, FIXED = "free", "recipe", "grow", "fixed"
T = TypeVar("T")
_SCHEMAS: dict[str, type] = {}  # by job: cls, det, seg
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class _Check:
    doc: str
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    exclusive_min: bool = False
    exclusive_max: bool = False
    required: bool = True  # False: a key only some options of its group have (e.g. data.train_split)
    length: tuple[int, int] | None = None  # a string's least and most characters
    forbid: str = ""  # characters a string may not hold
    resume: str | None = None  # FREE, RECIPE, GROW or FIXED; None: its section's
    in_run_name: bool | None = None  # names a sweep cell's folder; None: its section's (top level: yes)
    absent_means: Any = _ABSENT  # the value of a run recorded before the key existed

    def bounds(self) -> str:
        text = ""
        if self.min is not None:
            text += f" {'>' if self.exclusive_min else '>='} {self.min:g}"
        if self.max is not None:
            text += f"{' and' if self.min is not None else ''} {'<' if self.exclusive_max else '<='} {self.max:g}"
        if self.length is not None:
            text += f" of {self.length[0]} to {self.length[1]} characters"
        if self.forbid:
            text += f"{',' if self.length is not None else ''} none of {self.forbid}"
        return text

    def value_problem(self, value: Any) -> str | None:
        """What is wrong with one (non-null, well-typed) value, as the end of ``expected ...``."""
        if self.choices is not None and value not in self.choices:
            return f"one of {', '.join(map(str, self.choices))}"
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            return self.bounds().strip() or "a 64-bit integer"  # every integer key is bounded, by its own or by this
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            low = self.min is not None and (value <= self.min if self.exclusive_min else value < self.min)
            high = self.max is not None and (value >= self.max if self.exclusive_max else value > self.max)
            if low or high:
                return self.bounds().strip()
        if isinstance(value, str) and (
            (self.length is not None and not self.length[0] <= len(value) <= self.length[1])
            or any(c in self.forbid for c in value)
        ):
            return self.bounds().strip()
        return None


def key(
    doc: str,
    *,
    min: float | None = None,
    max: float | None = None,
    exclusive_min: bool = False,
    exclusive_max: bool = False,
    required: bool = True,
    length: tuple[int, int] | None = None,
    forbid: str = "",
    resume: str | None = None,
    in_run_name: bool | None = None,
    absent_means: Any = _ABSENT,
) -> Any:
    """A config key: its value comes from the YAML; ``doc`` says what it means; its annotation's ``Literal``
    (its choices), ``min``/``max``, or a string's ``length`` (least, most characters) and the characters it may not hold
    (``forbid``) bound it (for a list, each element). ``required=False``: only some options of its group
    have it (a dataset's keys: :mod:`cat.data.registry` says which).

    ``resume``: what resuming a run with the key changed does (FREE: applied from the resumed step on;
    RECIPE: the same, refused for a finished run, which has no step left to apply it to; GROW: the run's length,
    which may grow but not shrink below what the resumed checkpoint trained or began; FIXED: refused, it would be
    another run); None: as its section says (FREE at the top). ``in_run_name=False``: a sweep
    cell's folder name leaves the key out (where the data is, how many workers read it). ``absent_means``: the
    value a run recorded before the key existed had, for rebuilding such a run's model from its record."""
    check = _Check(
        doc,
        None,
        min,
        max,
        exclusive_min,
        exclusive_max,
        required,
        length,
        forbid,
        resume,
        in_run_name,
        absent_means,
    )
    return field(default=MISSING, metadata={"check": check})


def section(schema: type, doc: str, *, resume: str | None = None, in_run_name: bool | None = None) -> Any:
    """A nested section of keys, typed by the dataclass ``schema``; ``resume`` and ``in_run_name`` are its keys'
    unless a key says otherwise (:func:`key`)."""
    return field(default_factory=schema, metadata={"check": _Check(doc, resume=resume, in_run_name=in_run_name)})


def register_schema(name: str, schema: type) -> None:
    """Name ``schema`` as the job ``name``'s (for :func:`schema_of`: ``--help`` and the command-line check)."""
    _SCHEMAS[name] = schema


def schema_of(name: str) -> type:
    """The schema registered as job ``name``'s."""
    return _SCHEMAS[name]


_KEYS_OF: dict[type, tuple[tuple[str, Any, _Check], ...]] = {}


def _checks(schema: type) -> tuple[tuple[str, Any, _Check], ...]:
    """Each key of ``schema``: its name, its type, its check. Kept: a schema is a class defined once, and every
    composition (its folder-name keys), check and conversion walks it."""
    if schema not in _KEYS_OF:
        hints = typing.get_type_hints(schema)
        _KEYS_OF[schema] = tuple(
            (f.name, hints[f.name], _with_choices(hints[f.name], f.metadata["check"]))
            for f in dataclasses.fields(schema)
        )
    return _KEYS_OF[schema]


def _with_choices(annotation: Any, check: _Check) -> _Check:
    """``check`` with the choices a ``Literal`` annotation (or an optional one) names."""
    tp, _ = _unwrap_optional(annotation)
    return dataclasses.replace(check, choices=typing.get_args(tp)) if typing.get_origin(tp) is Literal else check


def _is_section(tp: Any) -> TypeGuard[type[Any]]:
    """Whether a key's annotation is a section of keys (a dataclass) rather than a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping"
    return _KINDS.get(tp, "anything")


def _is_type(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if typing.get_origin(tp) is Literal:  # one of the choices, of its type too (0 is not False)
        return any(type(value) is type(choice) and value == choice for choice in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if tp is int:
        return isinstance(value, int)
    if tp is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    origin = typing.get_origin(tp)
    if origin is list:
        return isinstance(value, list) and all(_is_type(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    raise TypeError(f"schema type {tp} is not supported")


def _expected(tp: Any, check: _Check, nullable: bool) -> str:
    text = f"one of {', '.join(map(str, check.choices))}" if check.choices is not None else _type_name(tp)
    return text + check.bounds() + (" (or null)" if nullable else "")


def mapping_problems(node: dict[str, Any], schema: type, prefix: str = "") -> list[str]:
    """Every way a plain mapping (a section of a config, its keys under ``prefix``) departs from ``schema``."""
    problems = []
    known = set()
    for name, annotation, check in _checks(schema):
        known.add(name)
        path = prefix + name
        if name not in node:
            if check.required:
                problems.append(f"{path}: missing from the config")
            continue
        value = node[name]
        if _is_section(annotation):
            if isinstance(value, dict):
                problems += mapping_problems(value, annotation, path + ".")
            else:
                problems.append(f"{path}={value!r}: expected a section of keys ({check.doc})")
            continue
        tp, nullable = _unwrap_optional(annotation)
        if value is None:
            if not nullable:
                problems.append(f"{path}=null: expected {_expected(tp, check, nullable)}")
            continue
        values = value if typing.get_origin(tp) is list and isinstance(value, list) else [value]
        if not _is_type(value, tp) or any(check.value_problem(v) is not None for v in values):
            shown = (
                repr(value) if len(repr(value)) <= 200 else f"{repr(value)[:120]}... ({len(repr(value))} characters)"
            )
            problems.append(f"{path}={shown}: expected {_expected(tp, check, nullable)}")
    problems += [unknown_key_problem(prefix + name, known) for name in node.keys() - known]
    return problems


def unknown_key_problem(path: str, known: Iterable[str]) -> str:
    """The line for a key (dotted ``path``) that its section of the schema does not declare."""
    return f"{path}: not a key of this config (known here: {', '.join(sorted(known))})"


def section_keys(schema: type, path: str) -> list[str] | None:
    """The keys the schema declares in the section at dotted ``path`` ('' for the top level): None
    for a free-form mapping (``model.kwargs``), [] for a single value or a path the schema lacks."""
    section: Any = schema
    for name in filter(None, path.split(".")):
        if not _is_section(section):
            break  # inside a mapping or below a value: what that is decides
        fields = {n: a for n, a, _ in _checks(section)}
        section = _unwrap_optional(fields[name])[0] if name in fields else None
    if _is_section(section):
        return [name for name, _, _ in _checks(section)]
    return None if _is_mapping(section) else []


def _is_mapping(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def schema_problems(cfg: DictConfig, schema: type) -> list[str]:
    """Every way ``cfg`` departs from ``schema``, one line each (``key=value: expected ...``)."""
    try:
        node = _plain(cfg)
    except Exception as error:  # an interpolation that does not resolve, or a ??? value left
        return [f"{str(error).strip().splitlines()[0]}"]
    return mapping_problems(node, schema)


def _plain(cfg: DictConfig) -> dict[str, Any]:
    """A composed config as plain data, interpolations resolved (a ??? value left raises)."""
    node = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(node, dict)  # a DictConfig's container
    return typing.cast(dict[str, Any], node)


def typed_section(schema: type[T], node: dict[str, Any]) -> T:
    """A plain mapping that :func:`mapping_problems` passed, as the dataclass ``schema`` (sections too); a key
    only some options have (``required=False``) and that this config lacks is None."""
    values = {}
    for name, annotation, _ in _checks(schema):
        value = node.get(name)
        values[name] = typed_section(annotation, value or {}) if _is_section(annotation) else value
    return schema(**values)


def typed_config(cfg: DictConfig, schema: type[T]) -> T:
    """``cfg``, composed by Hydra and checked against ``schema`` (:func:`schema_problems` found nothing), as the
    schema's dataclasses, interpolations resolved: the object every component reads its own section of."""
    return typed_section(schema, _plain(cfg))


def config_record(cfg: DataclassInstance) -> dict[str, Any]:
    """A typed config (or a section of one) as plain data: what a run's checkpoints, ``config.yaml`` and metric
    sinks record. A key this config's options lack (None in the object) is left out, as the composed config
    left it out."""
    record = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None and not f.metadata["check"].required:
            continue
        section = dataclasses.is_dataclass(value) and not isinstance(value, type)
        record[f.name] = config_record(value) if section else copy.deepcopy(value)
    return record


def config_yaml(cfg: DataclassInstance) -> str:
    """``config.yaml``'s text for a typed config."""
    return OmegaConf.to_yaml(OmegaConf.create(config_record(cfg)))


def _key_facts(schema: type, path: str) -> list[_Check]:
    """The checks of the sections along dotted ``path`` and of its key, outermost first; a path that runs
    into a mapping (``model.kwargs.depth``) stops at the mapping's key, one the schema lacks where it leaves it."""
    facts, section_type = [], schema
    for name in path.split("."):
        fields = {n: (a, c) for n, a, c in _checks(section_type)} if _is_section(section_type) else {}
        if name not in fields:
            break
        section_type, check = fields[name]
        facts.append(check)
    return facts


def key_rule(schema: type, path: str) -> str:
    """What a resume may do with the key at dotted ``path`` (FREE, RECIPE, GROW or FIXED): its own ``resume``, else
    its nearest section's; FREE for a key the schema does not declare (one a checkpoint recorded before it
    was removed)."""
    rules = [check.resume for check in _key_facts(schema, path) if check.resume is not None]
    return rules[-1] if rules else FREE


def run_length_key(schema: type) -> str:
    """The key that says how long a run of ``schema`` trains (declared GROW: ``epochs``, ``schedule.iters``)."""
    (length,) = [path for path, _, _ in schema_keys(schema) if key_rule(schema, path) == GROW]
    return length


def _in_run_name(schema: type, path: str) -> bool:
    names = [check.in_run_name for check in _key_facts(schema, path) if check.in_run_name is not None]
    return names[-1] if names else True


def run_name_excluded(schema: type) -> list[str]:
    """The keys a sweep cell's folder name leaves out (``in_run_name=False``), for Hydra's
    ``override_dirname.exclude_keys``."""
    return [path for path, _, _ in schema_keys(schema) if not _in_run_name(schema, path)]


def absent_defaults(schema: type) -> dict[str, Any]:
    """The keys of ``schema`` a run recorded before they existed lacks, with the value such a run had."""
    return {name: check.absent_means for name, _, check in _checks(schema) if check.absent_means is not _ABSENT}


def schema_keys(schema: type, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """Every key of ``schema``: (dotted name, expected type and bounds, doc)."""
    for name, annotation, check in _checks(schema):
        path = prefix + name
        if _is_section(annotation):
            yield from schema_keys(annotation, path + ".")
            continue
        tp, nullable = _unwrap_optional(annotation)
        yield path, _expected(tp, check, nullable), check.doc
