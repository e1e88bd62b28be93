"""Errors that are the user's to fix (a bad config value, a missing or hostile file).

Entry points and tools report a :class:`UserError` as one line and exit with status 2; anything
else is a bug and keeps its traceback. The base imports nothing so every layer can raise it.
"""

from __future__ import annotations

__all__ = [
    "UserError",
    "ConfigError",
    "CheckpointError",
    "DataError",
    "OutputError",
    "RunDirLockedError",
    "SweepCellError",
    "shortened",
]


def shortened(text: object, limit: int = 160) -> str:
    """``text`` (a path, a value) for a one-line message: one over ``limit`` characters cut in the middle, its
    length said."""
    text = str(text)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 3 :]} ({len(text)} characters)"


def _restored(cls: type[UserError], args: tuple, state: dict) -> UserError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class UserError(Exception):
    """Something the user can fix; its message says what and where."""

    def __reduce__(self) -> tuple:
        # Pickle (a sweep cell's error, sent to the sweep's process) would call the class with the message, which the
        # subclasses whose constructors build it from parts would wrap again ("invalid config: invalid config: ...").
        return _restored, (type(self), self.args, self.__dict__)


class ConfigError(UserError, ValueError):
    """One or more config values are invalid; the message has one line per problem."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(
            "invalid config:\n  " + "\n  ".join(self.problems)
            if len(self.problems) > 1
            else f"invalid config: {self.problems[0]}"
        )


class CheckpointError(UserError):
    """A checkpoint file is missing, unreadable or corrupt; the message names the file."""


class DataError(UserError):
    """A dataset file or folder is missing or unreadable; the message names it."""


class OutputError(UserError):
    """A run's output cannot be written (full disk) or its record in the folder is damaged."""


class RunDirLockedError(UserError):
    """Another live run holds the output folder."""


class SweepCellError(UserError):
    """A cell of a multirun ended with a user error. Raised in the cell rather than exiting, so Hydra records it
    (and submitit writes the cell's result: the sweep does not wait for one), and the sweep reports it once its
    other cells have run, with those of them that failed too; it pickles from a cell's process to the sweep's."""

    def __init__(self, message: str, sweep_dir: str | None = None, cell: str | None = None) -> None:
        super().__init__(message)
        self.sweep_dir, self.cell = sweep_dir, cell  # the sweep's folder, and the cell's folder name in it
