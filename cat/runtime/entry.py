"""How a cat entry point starts and ends: ``hydra.main`` on a trainer's config (:func:`hydra_entry`), Hydra's
refusals of the command line said in the schema's words, and user errors ending a run with one line
``error: ...`` and exit status 2 (:func:`report_user_errors`)."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import hydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from cat.errors import SweepCellError, UserError

from .cells import command_line_problems, other_failed_cells, record_refused_cell, sweep_of_cell
from .config_help import unnamed_keys
from .schema import schema_of, section_keys, unknown_key_problem

__all__ = ["hydra_entry", "report_user_errors", "user_error_message"]

F = TypeVar("F", bound=Callable[..., Any])


# While Hydra composes the config, HYDRA_FULL_ERROR=1 makes it raise its refusals of the command line
# instead of printing them; the user's own value ('' for none) waits here and is put back as the task
# starts, in whichever process runs it (a Slurm job inherits the submitting shell's environment).
_USERS_FULL_ERROR = "CAT_USERS_HYDRA_FULL_ERROR"


def _restore_full_error() -> None:
    users = os.environ.pop(_USERS_FULL_ERROR, None)
    if users:
        os.environ["HYDRA_FULL_ERROR"] = users
    elif users is not None:
        os.environ.pop("HYDRA_FULL_ERROR", None)


@contextlib.contextmanager
def _users_full_error() -> Iterator[None]:
    """The user's HYDRA_FULL_ERROR while a task runs, the entry's again after it: a multirun's in-process cells
    return to the sweep, whose failed cell the entry then reports."""
    at_entry = {name: os.environ.get(name) for name in (_USERS_FULL_ERROR, "HYDRA_FULL_ERROR")}
    _restore_full_error()
    try:
        yield
    finally:
        for name, value in at_entry.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def config_groups(config_dir: str) -> set[str]:
    """The config groups a trainer's command line can choose from: its config folder's subfolders and those of
    cat's shared configs (``pkg://cat.configs``)."""
    shared = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    return {
        entry.name
        for folder in (config_dir, shared)
        if os.path.isdir(folder)
        for entry in os.scandir(folder)
        if entry.is_dir() and not entry.name.startswith(("_", "."))
    }


def _collect_without_the_imports() -> None:
    """The cyclic garbage collector on, with every object alive now set aside from it (``gc.freeze``). The entry
    scripts turn it off before their imports: torch, torchvision, timm and Hydra leave ~700k objects that live as
    long as the process, and the collector walked them several times while they loaded and again at each later
    full collection (mmengine's datasets ask for two). A training process starts with ~1.3 CPU-s less of it (a
    toy Mask R-CNN run: ~1.8 s); the few cycles the imports left behind are never freed."""
    gc.freeze()
    gc.enable()


def hydra_entry(config_path: str, schema: str) -> Callable[[Callable[[DictConfig], None]], Callable[[], None]]:
    """``hydra.main`` on ``<config_path>/config.yaml`` for a trainer whose keys ``schema/<schema>``
    declares, with :func:`report_user_errors`. Hydra's own refusals of the command line (a key the
    config lacks, an option its group lacks, an override that does not parse) end it the same way, one
    line ``error: ...`` and exit status 2, instead of Hydra's report over several lines with status 1
    (whose advice for a mistyped key, '+key=value', the schema then refuses)."""

    def decorate(task: Callable[[DictConfig], None]) -> Callable[[], None]:
        reported_task = report_user_errors(task)

        @functools.wraps(task)
        def task_in_users_environment(cfg: DictConfig) -> None:
            with _users_full_error():  # around the report too: it shows a traceback for the user's HYDRA_FULL_ERROR
                reported_task(cfg)

        hydra_main = hydra.main(config_path=config_path, config_name="config", version_base="1.3")(
            task_in_users_environment
        )

        @functools.wraps(task)
        def entry() -> None:
            _collect_without_the_imports()
            groups = config_groups(os.path.join(os.path.dirname(inspect.getfile(task)), config_path))
            if problems := command_line_problems(sys.argv[1:], unnamed_keys(schema_of(schema)), groups):
                for problem in problems:
                    print(f"error: {problem}", file=sys.stderr, flush=True)
                raise SystemExit(2)
            users = os.environ.get("HYDRA_FULL_ERROR", "")
            os.environ.update({_USERS_FULL_ERROR: users, "HYDRA_FULL_ERROR": "1"})
            started = time.time()
            try:
                hydra_main()
            except (ConfigCompositionException, OverrideParseException, SweepCellError) as error:
                if users == "1":
                    raise
                if isinstance(error, SweepCellError):  # Hydra raises the first failed cell's error: the others first
                    problems = [*other_failed_cells(error, started), str(error)]
                else:
                    problems = [_command_line_problem(error, schema_of(schema))]
                for problem in problems:
                    print(f"error: {problem}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            finally:
                _restore_full_error()

        return entry

    return decorate


def _command_line_problem(error: ConfigCompositionException | OverrideParseException, schema: type) -> str:
    """Hydra's refusal of an override as one line, in the schema's words where it is about a key."""
    if isinstance(error, OverrideParseException):
        return f"{error.override}: not an override Hydra can parse ({error.message.splitlines()[0]})"
    if isinstance(error, MissingConfigException) and error.options is not None and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"{group}={option}: no such option (available: {', '.join(error.options)})"
    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        parent = cause.full_key.rpartition(".")[0]
        known = section_keys(schema, parent)
        name = cause.full_key.rpartition(".")[2]
        if known and name in known:  # a key of the schema the chosen option leaves out (data=synthetic: no mean)
            return (
                f"{cause.full_key}: the {parent} option chosen does not set it (its config has no such key: other "
                f"{parent} options use it); to set it anyway: ++{cause.full_key}=..."
            )
        if known:
            return unknown_key_problem(cause.full_key, known)
        if known is None:  # a free-form mapping (model.kwargs) takes new entries with '+', as Hydra says
            addition = str(error).splitlines()[-1].rpartition(" use ")[2]
            return f"{cause.full_key}: {parent} has no such entry; to add one: {addition}"
        return f"{cause.full_key}: {parent} is a single value, not a section of keys"
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _debug_requested(args: tuple[Any, ...]) -> bool:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return True
    return bool(args and isinstance(args[0], DictConfig) and args[0].get("debug", False))


def user_error_message(error: UserError) -> str:
    """A user error's message, as its one line ``error: ...`` says it."""
    message = str(error).strip()
    if "Original Traceback" in message:  # re-raised from a DataLoader worker: keep its own message
        message = message.splitlines()[-1].split(": ", 1)[-1]
    return message


def report_user_errors(main: F) -> F:
    """Decorate an entry point: a :class:`UserError` ends it with ``error: ...`` and exit status 2.

    Tracebacks stay for bugs, and for user errors with ``HYDRA_FULL_ERROR=1`` or ``debug=true``.
    """

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if _debug_requested(args):
                raise
            message = user_error_message(error)
            print(f"error: {message}", file=sys.stderr, flush=True)
            if (sweep := sweep_of_cell()) is not None:  # the sweep's other cells still run; it reports this one
                record_refused_cell(sweep, message)
                raise SweepCellError(
                    f"sweep cell {sweep.subdir or sweep.dir}: {message}", sweep.dir, sweep.subdir
                ) from None
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]
