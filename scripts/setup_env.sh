#!/usr/bin/env bash
# Creates ./.venv with everything cat needs. Idempotent: safe to re-run; a re-run only
# installs what is missing or at the wrong version.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python

# setuptools<81 still ships pkg_resources, which older OpenMMLab build scripts import.
"$VPY" -m pip install -q --disable-pip-version-check -U pip "setuptools<81" wheel
"$VPY" -m pip install -q --disable-pip-version-check -r requirements.txt
# The package itself, editable, so tools/ and the entry points import it from this checkout.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

"$VPY" - <<'PY'
import torch, timm, hydra
print(f"cat env ready: torch {torch.__version__}, timm {timm.__version__}, hydra {hydra.__version__}")
PY
