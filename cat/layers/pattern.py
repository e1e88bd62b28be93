"""Per-stage attention patterns of the hierarchical models: which blocks use circulant attention."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["parse_attn_pattern"]

_TOKEN = re.compile(r"C|S|M(\d+)")


def parse_attn_pattern(pattern: str, depths: Sequence[int]) -> list[int]:
    """Number of leading circulant blocks in each stage.

    One token per stage: ``C`` (all blocks circulant), ``S`` (the family's standard blocks) or
    ``M<k>`` (the first k blocks circulant, the rest standard). The paper's models are ``"CCSS"``;
    ``"SSSS"`` is the baseline. Example: ``parse_attn_pattern("CM2SS", (2, 4, 6, 2)) == [2, 2, 0, 0]``.
    """
    tokens = list(_TOKEN.finditer(pattern))
    if "".join(t.group(0) for t in tokens) != pattern or len(tokens) != len(depths):
        raise ValueError(
            f"attn_pattern {pattern!r} must be {len(depths)} tokens of C, S or M<k> (one per stage), "
            "e.g. 'CCSS' or 'CM2SS'"
        )
    counts = []
    for token, depth in zip(tokens, depths, strict=True):
        k = depth if token.group(0) == "C" else 0 if token.group(0) == "S" else int(token.group(1))
        if k > depth:
            raise ValueError(
                f"attn_pattern {pattern!r}: {token.group(0)} asks for {k} circulant blocks in a stage of depth {depth}"
            )
        counts.append(k)
    return counts
