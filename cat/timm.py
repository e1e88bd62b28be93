"""Run timm's own scripts with cat's models registered.

    python -m cat.timm SCRIPT [ARGS ...]
    torchrun --nproc_per_node=8 -m cat.timm SCRIPT [ARGS ...]

SCRIPT is one of timm's command-line scripts (``train.py``, ``validate.py``, ``benchmark.py``,
``inference.py`` of a pytorch-image-models checkout; the pip package does not ship them). They
build models by name with ``timm.create_model`` but do not import this package, and timm has no
plugin hook; this launcher imports ``cat`` (which registers its models with timm), registers cat's
Pillow-13-safe posterize in timm's augmentation table (:mod:`cat.data.augment`), and then runs
SCRIPT as ``__main__`` with ARGS, exactly as ``python SCRIPT ARGS`` would. Example:

    python -m cat.timm validate.py /data/imagenet --model ca_deit_small --pretrained
"""

from __future__ import annotations

import os
import runpy
import sys

import cat  # noqa: F401  (registers cat's models with timm)
from cat.data.augment import install_timm_augment_fixes


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"cat.timm: no script {script!r}; pass the path of a timm script such as validate.py")
    install_timm_augment_fixes()  # timm's RandAugment posterize on Pillow 13 (see cat.data.augment)
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python SCRIPT would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
