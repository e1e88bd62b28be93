#!/usr/bin/env python
"""What a Slurm sweep would submit, without submitting: the cells a multirun command expands to and
the sbatch script submitit writes for each of them (one job per cell).

Give the entry point and the overrides you would pass after ``-m``:

    python tools/slurm_preview.py train_cls.py hydra/launcher=slurm cluster.partition=gpu cluster.nodes=2 \\
        experiment=ca_deit_t,deit_t seed=0,1 data.root=/data/imagenet

The script is submitit's own (``--nodes``, ``--ntasks-per-node`` = one task per GPU, ``--gpus-per-node``,
``--time``, ``--signal=USR2@...`` for the save-and-requeue before the time limit, ...), built from the
launcher settings of the first cell's composed config; the cells differ only in their overrides.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from unittest import mock

import submitit
from hydra import compose, initialize_config_dir
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf
from submitit.slurm.slurm import SlurmExecutor

from cat.errors import ConfigError
from cat.runtime import report_user_errors
from cat.toolkit.sweeps import expand_sweep

REPO = Path(__file__).resolve().parents[1]
TASKS = {"train_cls.py": "cls", "train_det.py": "det", "train_seg.py": "seg"}
# hydra-submitit-launcher's generic parameters (its own list); the others are Slurm's (slurm_ prefix in submitit).
GENERIC = set(OmegaConf.structured(BaseQueueConf).keys())


def sbatch_script(launcher: dict, folder: str) -> str:
    """The sbatch script submitit writes for one job with these hydra-submitit-launcher settings."""
    launcher = {k: v for k, v in launcher.items() if k != "_target_" and v is not None}
    launcher.pop("submitit_folder", None)
    # submitit builds no Slurm executor where `srun` is not on PATH (a laptop, a CI runner); the preview submits
    # nothing, so it runs anywhere.
    with mock.patch.object(SlurmExecutor, "affinity", classmethod(lambda cls: 1)):
        executor = submitit.AutoExecutor(
            folder=folder, cluster="slurm", slurm_max_num_timeout=launcher.pop("max_num_timeout", 0)
        )
    executor.update_parameters(**{k if k in GENERIC else f"slurm_{k}": v for k, v in launcher.items()})
    # submitit builds the script only at submission; this is the function it uses to write it.
    return executor._executor._make_submission_file_text(f"python -u -m submitit.core._submit {folder}", "preview")


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("entry", choices=sorted(TASKS), help="the entry point the sweep runs")
    parser.add_argument("overrides", nargs="*", help="the overrides after -m (sweeps a,b,... allowed)")
    args = parser.parse_args(argv)

    hydra_overrides = [o for o in args.overrides if o.startswith(("hydra/", "hydra."))]
    task_overrides = [o for o in args.overrides if o not in hydra_overrides]
    if not any(o.startswith("hydra/launcher=") for o in hydra_overrides):
        raise ConfigError(
            "give the Slurm launcher: hydra/launcher=slurm (cat's preset) or hydra/launcher=submitit_slurm"
        )
    config_dir = str(REPO / "configs" / TASKS[args.entry])
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        first = expand_sweep(task_overrides)[0]
        cfg = compose(config_name="config", overrides=[*hydra_overrides, *first], return_hydra_config=True)
        params = cfg.hydra.sweeper.get("params")  # a sweep preset's axes
        cells = expand_sweep(task_overrides, OmegaConf.to_container(params) if params else None)
        cfg = compose(config_name="config", overrides=[*hydra_overrides, *cells[0]], return_hydra_config=True)
    if "timeout_min" not in cfg.hydra.launcher:
        raise ConfigError(f"{cfg.hydra.launcher._target_} is not a submitit launcher")
    cfg.hydra.job.name = Path(args.entry).stem
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    print(f"{len(cells)} cells, one Slurm job each, in {cfg.hydra.sweep.dir}/<cell overrides>:")
    for cell in cells:
        print("  " + " ".join(cell))
    print(f"\nsbatch script of each cell ({' '.join(cells[0])}):\n")
    with tempfile.TemporaryDirectory() as folder:  # submitit needs a folder; shown as the sweep's own
        print(sbatch_script(launcher, folder).replace(folder, launcher["submitit_folder"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
