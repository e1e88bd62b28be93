#!/usr/bin/env bash
# Creates ./.venv for cat. Idempotent: safe to re-run; a re-run only installs what is missing or
# at the wrong version.
#   bash scripts/setup_env.sh              what train_cls.py, the operator and the zoo need (requirements.txt)
#   bash scripts/setup_env.sh --dev        + tests, ruff and the tools' extras (requirements-dev.txt)
#   bash scripts/setup_env.sh --mm         + detection/segmentation: mmcv 2.1.0 built once and cached,
#                                            then requirements-mm.txt
# The flags combine; the README's test command uses both.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WITH_MM=0
WITH_DEV=0
for arg in "$@"; do
    case "$arg" in
        --mm) WITH_MM=1 ;;
        --dev) WITH_DEV=1 ;;
        *) echo "setup_env.sh: unknown option $arg (use --mm and/or --dev)" >&2; exit 2 ;;
    esac
done

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python

# setuptools<81 still ships pkg_resources, which older OpenMMLab build scripts import.
"$VPY" -m pip install -q --disable-pip-version-check -U pip "setuptools<81" wheel ninja
"$VPY" -m pip install -q --disable-pip-version-check -r requirements.txt
if [ "$WITH_DEV" = 1 ]; then
    "$VPY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
fi
# mmcv 2.1.0 with its compiled ops (mmdet 3.3 and mmseg 1.2 need mmcv._ext and accept mmcv<2.2 only).
# PyPI has only the sdist for this torch: build it once (~12 min on 2 cores) and cache the wheel,
# keyed by the torch version, so re-runs take seconds. mmcv puts -std=c++17 last on the compile
# line while torch 2.14's headers need C++20, so the compiler is wrapped to append -std=c++20.
if [ "$WITH_MM" = 1 ] && ! "$VPY" -c "import mmcv.ops" >/dev/null 2>&1; then
    TORCH_TAG=$("$VPY" -c "import torch; print(torch.__version__.replace('+', '_'))")
    WHEELS=${CAT_WHEEL_CACHE:-$HOME/.cache/cat/wheels}/torch-$TORCH_TAG
    if ! ls "$WHEELS"/mmcv-2.1.0-*.whl >/dev/null 2>&1; then
        echo "building mmcv 2.1.0 with ops against torch $TORCH_TAG (one time, ~12 minutes on 2 cores)"
        mkdir -p "$WHEELS"
        WRAP=$(mktemp -d)
        printf '#!/bin/sh\nexec g++ "$@" -std=c++20\n' > "$WRAP/g++-cxx20"
        chmod +x "$WRAP/g++-cxx20"
        # CUDA ops where a GPU is present; on a GPU-less build node export FORCE_CUDA=1 (and
        # TORCH_CUDA_ARCH_LIST) to compile them anyway.
        if [ -z "${FORCE_CUDA:-}" ]; then
            FORCE_CUDA=0
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FORCE_CUDA=1; fi
        fi
        CXX="$WRAP/g++-cxx20" MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-2} FORCE_CUDA=$FORCE_CUDA \
            "$VPY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
            -w "$WHEELS" mmcv==2.1.0
        rm -rf "$WRAP"
    fi
    "$VPY" -m pip install -q --disable-pip-version-check --no-deps "$WHEELS"/mmcv-2.1.0-*.whl
fi
if [ "$WITH_MM" = 1 ]; then
    "$VPY" -m pip install -q --disable-pip-version-check -r requirements-mm.txt
fi

# The package itself, editable, so tools/ and the entry points import it from this checkout.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

"$VPY" - <<'PY'
import torch, timm, hydra
print(f"cat env ready: torch {torch.__version__}, timm {timm.__version__}, hydra {hydra.__version__}")
PY
