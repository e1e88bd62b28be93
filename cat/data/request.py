"""What a dataset reader is asked for: a split, for one process of a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Split", "SplitRequest"]

Split = Literal["train", "val"]


@dataclass(frozen=True)
class SplitRequest:
    """The split to read and the process reading it: what a ``cache_mode=part`` zip holds and which shards a tar
    stream reads (``rank`` of ``world``), a training stream's length (whole batches of ``batch_size``) and order
    (``seed``), the class count bounding a packed split's labels (``num_classes``; the validation split gets the
    training split's), and where a split's index is kept for the node's other ranks (``index_dir``: the run
    folder; None: in memory)."""

    split: Split
    rank: int = 0
    world: int = 1
    batch_size: int = 1
    seed: int = 0
    num_classes: int | None = None
    index_dir: str | None = None

    @property
    def train(self) -> bool:
        return self.split == "train"
