"""Progress on a terminal and in batch logs (Slurm): a live bar, or plain lines without ``\\r``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

__all__ = ["interactive", "StepProgress", "progress_bar"]

T = TypeVar("T")


def interactive() -> bool:
    """True when stderr is a terminal (a bar redraws in place); false for logs and pipes."""
    return sys.stderr.isatty()


def progress_bar(items: Iterable[T], desc: str, enabled: bool, total: int | None = None) -> Iterator[T]:
    """A bar over ``items`` on a terminal; in a batch log, the items alone (the caller logs a summary)."""
    if enabled and interactive():
        yield from tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True)
    else:
        yield from items


class StepProgress:
    """An epoch's progress: on a terminal a bar with the latest loss; otherwise, every ``interval``
    steps, one log line ``<desc> step i/N  key value ...`` (``desc`` numbered as the epoch summary)."""

    def __init__(
        self, desc: str, total: int, first_step: int, interval: int, enabled: bool, log: logging.Logger
    ) -> None:
        self.desc, self.total, self.interval, self.log = desc, total, max(1, interval), log
        self.step = first_step
        self.bar = (
            tqdm(total=total, initial=first_step, desc=desc, leave=False, dynamic_ncols=True)
            if enabled and interactive()
            else None
        )
        self.enabled = enabled

    def update(self, fields: Callable[[], dict[str, str]]) -> None:
        """One step done; ``fields()`` (e.g. the loss, which syncs a GPU) is called only when shown."""
        self.step += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.step % self.interval == 0:
                self.bar.set_postfix(fields(), refresh=False)
        elif self.enabled and self.step % self.interval == 0:
            self.log.info(
                "%s step %d/%d  %s",
                self.desc,
                self.step,
                self.total,
                "  ".join(f"{k} {v}" for k, v in fields().items()),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
