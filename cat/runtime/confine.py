"""A run's writes confined by the kernel: Landlock (Linux 5.13 and later, no privileges needed).

A process restricts itself, once, before it builds anything from the user's config: from then on it, every thread it
starts and every process it forks or executes (data workers, W&B's service, a hook's subprocess) can create, write,
rename or delete files only beneath the folders :func:`writable_folders` lists. Reading stays free. What was already
open stays open (stdout, a Slurm log). A refused write fails with EACCES at the call that tried it, before anything
is written; :func:`refused_write` turns that into one line naming the path and the key that allows it.

The binding is the three system calls and their structures, through ctypes: nothing to install, and the whole of it
can be read in one page (the PyPI ``landlock`` package wraps the same calls behind a pre-1.0 API).
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Confinement",
    "abi_version",
    "cache_folders",
    "confine",
    "confinement",
    "refused_write",
    "writable_folders",
]

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same numbers on x86_64 and arm64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_O_PATH = getattr(os, "O_PATH", 0o10000000)

# What the ruleset governs (linux/landlock.h): every way to change the file tree. Reading, listing and executing
# are not governed, so they stay allowed everywhere; so does ioctl on devices (a GPU driver's own calls).
_WRITE_FILE = 1 << 1
_REMOVE_DIR, _REMOVE_FILE = 1 << 4, 1 << 5
_MAKE_CHAR, _MAKE_DIR, _MAKE_REG, _MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM = (1 << n for n in range(6, 13))
_REFER = 1 << 13  # ABI 2: renames and links across folders
_TRUNCATE = 1 << 14  # ABI 3
_FILE_RIGHTS = _WRITE_FILE | _TRUNCATE  # the rights that apply to a file itself (the rest are a folder's)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The Landlock ABI this kernel offers; 0 where it has none (not Linux, too old, or disabled at boot)."""
    if os.uname().sysname != "Linux":
        return 0
    version = _libc().syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def _handled(abi: int) -> int:
    rights = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE
    rights |= _MAKE_CHAR | _MAKE_DIR | _MAKE_REG | _MAKE_SOCK | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def cache_folders(gpu: bool) -> list[str]:
    """The folders the software stack writes its caches in, from the variables that move them: torch hub and
    Inductor, Triton and CUDA (with ``gpu``), W&B, matplotlib, Hugging Face and cat's own (all under the XDG cache
    folder unless moved)."""
    home = os.path.expanduser("~")
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    folders = [cache_home, os.path.join(config_home, "wandb"), os.path.join(config_home, "matplotlib")]
    moved: tuple[str, ...] = (
        "TORCH_HOME",
        "TORCHINDUCTOR_CACHE_DIR",
        "WANDB_DIR",
        "WANDB_CACHE_DIR",
        "WANDB_CONFIG_DIR",
        "WANDB_DATA_DIR",
        "MPLCONFIGDIR",
        "HF_HOME",
    )
    if gpu:
        folders += [os.path.join(home, ".triton"), os.path.join(home, ".nv")]
        moved += ("TRITON_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH")
    folders += [os.environ[name] for name in moved if os.environ.get(name)]
    return folders


def writable_folders(run_folder: str, may_write: Iterable[str] = (), gpu: bool = False) -> list[str]:
    """Where a confined run may write: its run folder, the temporary folder, ``/dev`` (``/dev/shm``, ``/dev/null``
    and the GPU's device files), the stack's caches (:func:`cache_folders`) and the user's ``may_write``."""
    folders = [run_folder, tempfile.gettempdir(), "/dev", *cache_folders(gpu), *may_write]
    return list(dict.fromkeys(os.path.realpath(os.path.expanduser(folder)) for folder in folders))


@dataclass(frozen=True)
class Confinement:
    """What this process was confined to: the folders, and the key a user sets to allow another."""

    folders: tuple[str, ...]

    def allows(self, path: str) -> bool:
        """Whether ``path`` lies beneath one of the folders (links resolved as far as they exist)."""
        real = os.path.realpath(path)
        return any(real == folder or real.startswith(folder.rstrip("/") + "/") for folder in self.folders)


_confined: Confinement | None = None


def confinement() -> Confinement | None:
    """This process's confinement, if it confined itself (a forked child inherits both the kernel's rules and this)."""
    return _confined


def confine(folders: Sequence[str]) -> Confinement:
    """Restrict this process (and its future threads and children) to writing beneath ``folders``, which are made if
    missing (one that cannot be, a file standing there, is left out). Once per process: a second call with folders
    the first already allows does nothing; one that would need more raises (the kernel only ever narrows a
    confinement). OSError where the kernel has no Landlock."""
    global _confined
    if _confined is not None:
        if all(_confined.allows(folder) for folder in folders):
            return _confined
        outside = [folder for folder in folders if not _confined.allows(folder)]
        raise PermissionError(
            errno.EACCES, f"this process is already confined to {', '.join(_confined.folders)}", outside[0]
        )
    abi = abi_version()
    if abi < 1:
        raise OSError(errno.ENOSYS, "this kernel has no Landlock (Linux 5.13 or later, enabled at boot)")
    libc = _libc()
    handled = _handled(abi)
    attr = _RulesetAttr(handled)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        kept = []
        for folder in folders:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError:  # a file stands there (XDG_CACHE_HOME=/dev/null): nothing can be made beneath it
                continue
            fd = os.open(folder, _O_PATH | os.O_CLOEXEC)
            try:
                rights = handled if os.path.isdir(folder) else handled & _FILE_RIGHTS
                rule = _PathBeneathAttr(rights, fd)
                if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({folder}): {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            kept.append(folder)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    _confined = Confinement(tuple(kept))
    return _confined


def refused_write(error: BaseException) -> str | None:
    """One line for a write the confinement refused (a PermissionError on a path outside it), else None."""
    if _confined is None or not isinstance(error, PermissionError) or not error.filename:
        return None
    path = os.fspath(error.filename)
    if _confined.allows(path):
        return None  # refused by the file's own permissions, not by the confinement
    parent = os.path.dirname(os.path.abspath(path))
    return (
        f"the run may not write {path}: a run writes only in its output_dir, the temporary folder and the stack's "
        f"caches (run.confine); to allow that folder: run.may_write=[{parent}]"
    )
