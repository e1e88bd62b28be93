"""What every cat job shares: distributed setup, the run folder and its lock, atomic I/O, config
checks, console progress and how user errors end a run. Imports ``cat.models`` and below only."""
from .dist import DistEnv, all_reduce_sum, barrier, broadcast_object, init_distributed
from .io import atomic_save, atomic_write_json, atomic_write_text, remove_stale_temporaries
from .job import RunFolder, open_run_folder, report_user_errors, run_dir_for
from .rundir import RunDirLock, check_writable
from .validate import Rule, validate_config

__all__ = ["DistEnv", "all_reduce_sum", "barrier", "broadcast_object", "init_distributed", "atomic_save",
           "atomic_write_json", "atomic_write_text", "remove_stale_temporaries", "RunFolder", "open_run_folder",
           "report_user_errors", "run_dir_for", "RunDirLock", "check_writable", "Rule",
           "validate_config"]
