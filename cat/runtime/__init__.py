"""What every cat job shares: one job lifecycle, distributed setup, the run folder and its lock,
atomic I/O, config checks, seeding and RNG state, mixed precision, console progress and how user
errors end a run. Imports ``cat.models`` and below only."""

from . import config_help  # noqa: F401  (registers the resolvers Hydra asks while composing)
from .amp import AMP_DTYPES, Precision, amp_dtype, autocast_for, describe_precision, resolve_amp
from .cells import typed_job_config
from .dist import DistEnv, all_reduce_sum, barrier, broadcast_object, init_distributed
from .entry import hydra_entry, report_user_errors
from .folder import RunFolder, open_run_folder, run_dir_for
from .io import atomic_save, atomic_write_json, atomic_write_text, remove_stale_temporaries
from .job import run_job
from .job_config import JobConfig
from .ownership import RunDirLock, check_writable
from .rng import capture_rng_state, restore_rng_state, seed_everything
from .schema import key, register_schema, schema_problems, section

__all__ = [
    "AMP_DTYPES",
    "amp_dtype",
    "autocast_for",
    "describe_precision",
    "resolve_amp",
    "Precision",
    "DistEnv",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "init_distributed",
    "atomic_save",
    "atomic_write_json",
    "atomic_write_text",
    "remove_stale_temporaries",
    "RunFolder",
    "hydra_entry",
    "open_run_folder",
    "report_user_errors",
    "run_dir_for",
    "run_job",
    "typed_job_config",
    "capture_rng_state",
    "restore_rng_state",
    "seed_everything",
    "RunDirLock",
    "check_writable",
    "JobConfig",
    "key",
    "section",
    "register_schema",
    "schema_problems",
]
