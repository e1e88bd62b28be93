"""Console logging, and the W&B settings a run keeps (its mode, its persistent run id)."""

from __future__ import annotations

import contextlib
import io
import logging
import netrc
import os
import re
import secrets
import sys

from cat.errors import OutputError

from .io import open_append, open_owned, read_owned

__all__ = [
    "FILE_ONLY",
    "LOG_TIME_FORMAT",
    "log_formatter",
    "last_log_line",
    "setup_logging",
    "wandb_api_key_configured",
    "resolve_wandb_mode",
    "persistent_run_id",
    "run_id_problem",
]


# ``extra=`` of a record for ``log_file`` alone: what the console says its own way (an error line, a traceback).
FILE_ONLY = {"file_only": True}
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # each line of a run's log.txt starts [<this time>]


def log_formatter() -> logging.Formatter:
    """How a line of a run's log reads: ``[<time>] <message>``."""
    return logging.Formatter("[%(asctime)s] %(message)s", LOG_TIME_FORMAT)


def last_log_line(path: str) -> str | None:
    """The last line of a run's log (``path``) without its time stamp, its unprintable characters as spaces (a
    failed run's error, to show); None if it has none. Reads the file's tail only: a log may be long."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        tail = f.read().decode("utf-8", errors="replace")
    lines = [line for line in tail.split("\n") if line.strip()]  # only a newline ends a line of the log
    if not lines:
        return None
    line = re.sub(r"^\[[\d: -]+\] ", "", lines[-1].strip())
    return "".join(c if c.isprintable() else " " for c in line)


# The loggers a run's lines come from, each named for what it logs: the run itself (lifecycle, training,
# evaluation), its data readers, its metric sinks. Module loggers (``cat.models.loading``) keep their names.
RUN_LOGGER, DATA_LOGGER, METRICS_LOGGER = "cat.train", "cat.data", "cat.metrics"


class _RunLogHandler(logging.FileHandler):
    """``log.txt``, opened as every file a run appends to (:func:`cat.runtime.io.open_append`): never through a
    link or into a FIFO, and what it cannot encode written escaped rather than lost to a logging error."""

    def _open(self) -> io.TextIOWrapper:
        return open_append(self.baseFilename)


def setup_logging(is_main: bool, log_file: str | None = None) -> logging.Logger:
    """The run's log: every ``cat.*`` logger's records at INFO to stdout (and ``log_file``) on rank 0, warnings
    only elsewhere; records logged with ``extra=FILE_ONLY`` go to ``log_file`` alone. Returns the run's own
    logger (:data:`RUN_LOGGER`); the handlers sit on the package's root logger, which nothing logs to itself."""
    logger = logging.getLogger("cat")
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    # A file name that is not UTF-8 (kept by Python as surrogates) is printed escaped, not lost to a logging error.
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    console = logging.StreamHandler(sys.stdout)
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    handlers: list[logging.Handler] = [console]
    if is_main and log_file:
        handlers.append(_RunLogHandler(log_file))
    for handler in handlers:
        handler.setFormatter(log_formatter())
        logger.addHandler(handler)
    return logging.getLogger(RUN_LOGGER)


def wandb_api_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(os.environ.get("WANDB_BASE_HOST", "api.wandb.ai")) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    """``auto`` is online when an API key is configured and offline otherwise."""
    if mode == "auto":
        return "online" if wandb_api_key_configured() else "offline"
    if mode not in ("online", "offline", "disabled"):
        raise ValueError(f"logger.wandb.mode must be auto, online, offline or disabled; got {mode!r}")
    return mode


RUN_ID_FILE = "wandb_run_id.txt"
_RUN_ID = re.compile(r"[0-9a-z]{1,64}")


def run_id_problem(output_dir: str) -> str | None:
    """What is wrong with ``output_dir``'s W&B run id file, if it exists and is not one cat wrote."""
    path = os.path.join(output_dir, RUN_ID_FILE)
    if not os.path.lexists(path):
        return None
    try:
        text = read_owned(path, 256).decode("ascii").strip()
    except OutputError as error:
        return str(error)
    except (OSError, UnicodeDecodeError) as error:
        return f"{path} cannot be read ({type(error).__name__}); delete it to start a new W&B run"
    if _RUN_ID.fullmatch(text) is None:
        return (
            f"{path} holds {text[:40]!r}, not a W&B run id (lowercase letters and digits); "
            "delete it to start a new W&B run"
        )
    return None


def persistent_run_id(output_dir: str) -> str:
    """The W&B run id of ``output_dir``, created on first use, so resumed runs continue one W&B run."""
    path = os.path.join(output_dir, RUN_ID_FILE)
    if not os.path.lexists(path):
        os.makedirs(output_dir, exist_ok=True)
        with open(open_owned(path, "x"), "w") as f:
            f.write(secrets.token_hex(4))
    problem = run_id_problem(output_dir)
    if problem is not None:
        raise OutputError(problem)
    return read_owned(path, 256).decode("ascii").strip()
