"""Where a detection/segmentation config's base comes from (``model.base``): a config packaged with mmdet or
mmseg (``mmdet::path/in/its/configs.py``), resolved inside that package's config tree, or a plain path to the
user's own mmengine config. Names are checked without importing anything: an mmengine config is Python, and
only the file the user meant is ever run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from cat.errors import ConfigError, shortened

__all__ = ["BASE_PACKAGES", "base_config_path"]

BASE_PACKAGES = ("mmdet", "mmseg")  # the packages whose shipped configs a base may name with <package>::


def base_config_path(spec: str) -> Path:
    """The file ``model.base=spec`` names; a ConfigError (one line) where it names another package, leads out of
    the package's config tree, or is no file."""
    try:
        return _base_config_path(spec)
    except OSError as error:  # a name over the filesystem's limit, a folder that cannot be read on the way
        raise ConfigError(f"model.base={shortened(spec, 120)}: cannot be looked up ({error.strerror})") from None


def _base_config_path(spec: str) -> Path:
    package, sep, relative = spec.partition("::")
    if not sep:
        if not os.path.isfile(spec):
            raise ConfigError(f"model.base={spec}: no such config file (or one mmdet or mmseg ships: mmdet::...)")
        return Path(spec)
    if package not in BASE_PACKAGES:
        raise ConfigError(
            f"model.base={spec}: {package}:: is not a package cat takes configs from ({', '.join(BASE_PACKAGES)}; "
            "or give a path to your own config file)"
        )
    found = importlib.util.find_spec(package)  # finds the package without running it
    if found is None or found.origin is None:
        raise ConfigError(f"model.base={spec}: {package} is not installed (bash scripts/setup_env.sh --mm)")
    root = (Path(found.origin).parent / ".mim" / "configs").resolve()
    path = (root / relative).resolve()
    if os.path.isabs(relative) or not path.is_relative_to(root):
        raise ConfigError(f"model.base={spec}: leads outside {package}'s config tree ({root})")
    if not path.is_file():
        raise ConfigError(f"model.base={spec}: {package} ships no config {relative} (looked in {root})")
    return path
