"""Hydra multirun sweeps as data: the cells a command line (plus ``hydra.sweeper.params``) expands
to, in Hydra's own spelling, so a cell's folder can be matched to the cell it was launched as."""

from __future__ import annotations

import itertools
import math

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

from cat.errors import ConfigError
from cat.runtime.cells import MAX_SWEEP_CELLS, RANGE_PROBLEM, range_length

__all__ = ["MAX_SWEEP_CELLS", "override_axes", "expand_sweep"]


def _axis_length(override) -> int:
    """How many values a sweep override stands for, counted without expanding it."""
    value = override.value()
    if isinstance(value, RangeSweep):
        if (length := range_length(value)) is None:  # a step of 0 or an infinite bound: Python's range() refuses
            raise ConfigError(f"{override.input_line}: {RANGE_PROBLEM}")
        return length
    if isinstance(value, ChoiceSweep):
        return len(value.list)
    raise ConfigError(f"{override.input_line}: only choice (a,b) and range() sweeps are expanded")


def override_axes(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """Per override, its key and its ``key=value`` choices (one unless it sweeps ``a,b,...``).
    A ConfigError when they would make more than :data:`MAX_SWEEP_CELLS` cells."""
    if not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"overrides must be strings 'key=value', got {overrides!r:.120}")
    parsed = OverridesParser.create().parse_overrides(overrides)
    lengths = {o.get_key_element(): _axis_length(o) for o in parsed if o.is_sweep_override()}
    cells = math.prod(lengths.values())
    if cells > MAX_SWEEP_CELLS:
        sizes = " x ".join(f"{key}: {n}" for key, n in lengths.items())
        raise ConfigError(f"the sweep asks for {cells:,} cells ({sizes}); at most {MAX_SWEEP_CELLS:,} are expanded")
    axes = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
        axes.append((key, [f"{key}={value}" for value in values]))
    return axes


def expand_sweep(overrides: list[str], params: dict[str, str] | None = None) -> list[tuple[str, ...]]:
    """Every cell of the sweep, each a sorted tuple of ``key=value``; ``params`` (a sweep preset's
    ``hydra.sweeper.params``) add axes, and the command line wins where both set a key."""
    overrides = list(overrides)
    given = {key for key, _ in override_axes(overrides)}
    overrides += [f"{key}={value}" for key, value in (params or {}).items() if key not in given]
    return [tuple(sorted(cell)) for cell in itertools.product(*(values for _, values in override_axes(overrides)))]
