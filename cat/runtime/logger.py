"""Console logging and Weights & Biases, on rank 0 only."""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import sys
from typing import Any

__all__ = ["setup_logging", "WandbLogger", "wandb_api_key_configured", "resolve_wandb_mode", "persistent_run_id"]


def setup_logging(is_main: bool, log_file: str | None = None) -> logging.Logger:
    """The ``cat`` logger: INFO to stdout (and ``log_file``) on rank 0, warnings only elsewhere."""
    logger = logging.getLogger("cat")
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if is_main and log_file:
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    return logger


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


def persistent_run_id(output_dir: str) -> str:
    """The W&B run id of ``output_dir``, created on first use, so resumed runs continue one W&B run."""
    path = os.path.join(output_dir, "wandb_run_id.txt")
    if not os.path.isfile(path):
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(secrets.token_hex(4))
    with open(path) as f:
        return f.read().strip()


class WandbLogger:
    """A W&B run in ``output_dir/wandb`` that resumes with the training run (its id is kept there).

    ``mode='auto'`` is online when an API key is configured and offline otherwise.
    """

    def __init__(self, cfg: Any, output_dir: str, config: dict[str, Any], enabled: bool = True) -> None:
        mode = resolve_wandb_mode(cfg.mode)
        self.run = None
        if not enabled or mode == "disabled":
            return
        import wandb

        self.run = wandb.init(
            mode=mode,
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            tags=list(cfg.tags),
            config=config,
            dir=output_dir,
            id=persistent_run_id(output_dir),
            resume="allow",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
