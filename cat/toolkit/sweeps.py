"""Hydra multirun sweeps as data: the cells a command line (plus ``hydra.sweeper.params``) expands
to, in Hydra's own spelling, so a cell's folder can be matched to the cell it was launched as."""

from __future__ import annotations

import itertools

from hydra.core.override_parser.overrides_parser import OverridesParser

__all__ = ["override_axes", "expand_sweep"]


def override_axes(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """Per override, its key and its ``key=value`` choices (one unless it sweeps ``a,b,...``)."""
    axes = []
    for override in OverridesParser.create().parse_overrides(overrides):
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
