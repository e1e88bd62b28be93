"""Check a whole config before any data or model is built: one line per problem, all at once."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from cat.errors import ConfigError

from .rundir import check_writable

__all__ = ["Rule", "config_problems", "validate_config"]

_ABSENT = object()
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


@dataclass(frozen=True)
class Rule:
    """``key`` must be a ``kind`` (int, float, bool, str) within [``min``, ``max``] or one of ``choices``."""

    key: str
    kind: str
    min: float | None = None
    max: float | None = None
    choices: Sequence[Any] | None = None
    nullable: bool = False
    exclusive_min: bool = False

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else f"{self.key}=null: expected {self._expected()}"
        if not _is_kind(value, self.kind):
            return f"{self.key}={value!r}: expected {self._expected()}"
        if self.choices is not None and value not in self.choices:
            return f"{self.key}={value!r}: expected one of {', '.join(map(str, self.choices))}"
        too_low = self.min is not None and (value <= self.min if self.exclusive_min else value < self.min)
        if too_low or (self.max is not None and value > self.max):
            return f"{self.key}={value!r}: expected {self._expected()}"
        return None

    def _expected(self) -> str:
        if self.choices is not None:
            return f"one of {', '.join(map(str, self.choices))}"
        text = _KINDS[self.kind]
        if self.min is not None:
            text += f" {'>' if self.exclusive_min else '>='} {self.min:g}"
        if self.max is not None:
            text += f"{' and' if self.min is not None else ''} <= {self.max:g}"
        return text + (" (or null)" if self.nullable else "")


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, str)


def config_problems(
    cfg: DictConfig, rules: Iterable[Rule], writable_dirs: Iterable[str] = ("output_dir",)
) -> list[str]:
    """Every problem with ``cfg``: rule violations and output folders that cannot be written."""
    problems = []
    for rule in rules:
        value = OmegaConf.select(cfg, rule.key, default=_ABSENT, throw_on_missing=False)
        if value is _ABSENT:
            problems.append(f"{rule.key}: missing from the config")
        elif (problem := rule.problem(value)) is not None:
            problems.append(problem)
    for key in writable_dirs:
        folder = OmegaConf.select(cfg, key)
        if not isinstance(folder, str) or not folder:
            problems.append(f"{key}={folder!r}: expected a folder path")
        elif (problem := check_writable(folder, key)) is not None:
            problems.append(problem)
    return problems


def validate_config(cfg: DictConfig, rules: Iterable[Rule], extra_problems: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigError` listing every problem, if there is any."""
    problems = config_problems(cfg, rules) + list(extra_problems)
    if problems:
        raise ConfigError(problems)
