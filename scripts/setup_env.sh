#!/usr/bin/env bash
# Creates ./.venv for cat. Idempotent: safe to re-run; a re-run only installs what is missing or
# at the wrong version.
#   bash scripts/setup_env.sh              what train_cls.py, the operator and the zoo need (requirements.txt)
#   bash scripts/setup_env.sh --dev        + tests, ruff and the tools' extras (requirements-dev.txt)
#   bash scripts/setup_env.sh --mm         + detection/segmentation: mmcv 2.1.0 built once and cached,
#                                            then requirements-mm.txt
# The flags combine; the README's test command uses both.
# The pinned sets are installed with uv where it is on the PATH or can be installed (into ~/.cache/cat/uv, a few
# seconds): several times faster than pip, from the same indexes pip is configured with; CAT_INSTALLER=pip forces
# pip. Where uv cannot install a set, pip installs it.
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
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/cat

TEMPORARY=()  # folders this run made for itself, removed as it ends
trap 'rm -rf "${TEMPORARY[@]}"' EXIT

# A cached executable or wheel is used only if it is what this script made: a plain file owned by this user, which
# neither it nor any folder up to the cache's root lets group or others write, and whose SHA-256 matches the record
# (FILE.sha256, held to the same rules) written when it was made. Anything else is ignored, said so, and made again.
private() {  # private PATH ROOT: PATH and every folder from it up to ROOT: no link, this user's, not g/o-writable
    local path=$1 root=$2 mode
    while :; do
        if [ -L "$path" ] || [ ! -e "$path" ] || [ "$(stat -c %u "$path")" != "$(id -u)" ]; then return 1; fi
        mode=$(stat -c %a "$path")
        if (( 8#$mode & 8#022 )); then return 1; fi
        if [ "$path" = "$root" ] || [ "$path" = / ] || [ "$path" = . ]; then return 0; fi
        path=$(dirname "$path")
    done
}
verified() {  # verified FILE ROOT: FILE is private to ROOT and matches its recorded hash
    [ -f "$1" ] && private "$1" "$2" && private "$1.sha256" "$2" \
        && [ "$(sha256sum < "$1" | cut -d' ' -f1)" = "$(cat "$1.sha256")" ]
}
record_hash() {  # record_hash FILE: what verified checks it against later
    (umask 022; sha256sum < "$1" | cut -d' ' -f1 > "$1.sha256")
}
# make_private FOLDER ROOT: FOLDER made (mode 755 under umask 022) where missing; fails unless private to ROOT.
make_private() {
    (umask 022; mkdir -p "$1") && private "$1" "$2"
}
# A cache folder this script cannot trust (another user's, writable by others) is not written: a private temporary
# one stands in for it for this run.
if ! make_private "$CACHE" "$CACHE" 2>/dev/null; then
    echo "setup_env.sh: $CACHE is not private to you (another user's, a link, or writable by group or others):" \
        "not using it; this run uses a temporary cache" >&2
    CACHE=$(mktemp -d)
    TEMPORARY+=("$CACHE")
fi

# uv: on the PATH, else the copy this script installed before (verified), else installed now (pip into the cache).
# Empty: pip.
find_uv() {
    [ "${CAT_INSTALLER:-uv}" = uv ] || return 0
    if command -v uv >/dev/null 2>&1; then command -v uv; return 0; fi
    local uv=$CACHE/uv/bin/uv
    if [ -e "$CACHE/uv" ] || [ -L "$CACHE/uv" ]; then
        if verified "$uv" "$CACHE"; then echo "$uv"; return 0; fi
        echo "setup_env.sh: ignoring the cached $CACHE/uv (not owned by you, writable by others, or not what this" \
            "script installed there): installing uv again" >&2
        rm -rf "$CACHE/uv" || return 0
    fi
    (umask 022; "$PYTHON" -m pip install -q --disable-pip-version-check --target "$CACHE/uv" "uv>=0.13,<0.14") \
        >/dev/null 2>&1 || return 0
    [ -x "$uv" ] || return 0
    record_hash "$uv"
    echo "$uv"
}
UV=$(find_uv)

# The sources pip is configured with (index, extra indexes, find-links, constraints), passed on to uv, which reads no
# pip configuration: both install the same pins from the same places.
uv_sources() {
    local key value item
    while IFS='=' read -r key value; do
        value=${value#\'}
        value=${value%\'}
        case "$key" in
            *index-url)
                for item in $value; do
                    if [ "${key##*.}" = index-url ]; then echo --index-url; else echo --extra-index-url; fi
                    echo "$item"
                done ;;
            *find-links) for item in $value; do echo --find-links; echo "$item"; done ;;
            *constraint) for item in $value; do echo --constraint; echo "$item"; done ;;
        esac
    done < <("$PYTHON" -m pip config list 2>/dev/null)
    # pip considers every index for every package; uv only the first that has it, unless told.
    echo --index-strategy
    echo unsafe-best-match
}

if [ ! -x .venv/bin/python ]; then
    if [ -n "$UV" ]; then "$UV" venv -q --python "$PYTHON" .venv; else "$PYTHON" -m venv .venv; fi
fi
VPY=.venv/bin/python

# Install into .venv with uv (pip where uv is absent or cannot), quietly. Both leave the packages compiled to
# bytecode (pip does by default, uv when told): without it every new interpreter compiles torch, timm and the rest
# from source again wherever bytecode is not written back (PYTHONDONTWRITEBYTECODE=1, a read-only venv), about 5 s
# a process here, and the test suite starts hundreds. CAT_COMPILE_BYTECODE=0 leaves it out (~35 CPU-seconds of a
# fresh venv's 40): for a throwaway venv, as the script's own tests make.
SOURCES=()
if [ -n "$UV" ]; then mapfile -t SOURCES < <(uv_sources); fi
UV_BYTECODE=(--compile-bytecode)
PIP_BYTECODE=()
if [ "${CAT_COMPILE_BYTECODE:-1}" = 0 ]; then UV_BYTECODE=(); PIP_BYTECODE=(--no-compile); fi
install() {
    if [ -n "$UV" ]; then
        if "$UV" pip install -q "${UV_BYTECODE[@]}" --python "$VPY" "${SOURCES[@]}" "$@"; then return 0; fi
        echo "setup_env.sh: uv could not install $*; installing with pip" >&2
        "$UV" pip install -q --python "$VPY" pip >/dev/null 2>&1 || true
    fi
    "$VPY" -m pip install -q --disable-pip-version-check "${PIP_BYTECODE[@]}" "$@"
}

# setuptools<81 still ships pkg_resources, which older OpenMMLab build scripts import; pip builds mmcv's wheel.
install -U pip "setuptools<81" wheel ninja
install -r requirements.txt
if [ "$WITH_DEV" = 1 ]; then
    install -r requirements-dev.txt
fi
# mmcv 2.1.0 with its compiled ops (mmdet 3.3 and mmseg 1.2 need mmcv._ext and accept mmcv<2.2 only).
# PyPI has only the sdist for this torch: build it once (~12 min on 2 cores) and cache the wheel,
# keyed by the torch version, so re-runs take seconds. mmcv puts -std=c++17 last on the compile
# line while torch 2.14's headers need C++20, so the compiler is wrapped to append -std=c++20.
if [ "$WITH_MM" = 1 ] && ! "$VPY" -c "import mmcv.ops" >/dev/null 2>&1; then
    TORCH_TAG=$("$VPY" -c "import torch; print(torch.__version__.replace('+', '_'))")
    WHEEL_ROOT=${CAT_WHEEL_CACHE:-$CACHE/wheels}
    WHEELS=$WHEEL_ROOT/torch-$TORCH_TAG
    if ! make_private "$WHEELS" "$WHEEL_ROOT" 2>/dev/null; then
        echo "setup_env.sh: $WHEELS is not private to you: building mmcv in a temporary folder" >&2
        WHEELS=$(mktemp -d)
        WHEEL_ROOT=$WHEELS
        TEMPORARY+=("$WHEELS")
    fi
    WHEEL=$(find "$WHEELS" -maxdepth 1 -name 'mmcv-2.1.0-*.whl' -print -quit)
    if [ -n "$WHEEL" ] && ! verified "$WHEEL" "$WHEEL_ROOT"; then
        echo "setup_env.sh: ignoring the cached $WHEEL (not owned by you, writable by others, or not the wheel" \
            "this script built): building it again" >&2
        rm -f "$WHEEL" "$WHEEL.sha256"
        WHEEL=
    fi
    if [ -z "$WHEEL" ]; then
        echo "building mmcv 2.1.0 with ops against torch $TORCH_TAG (one time, ~12 minutes on 2 cores)"
        WRAP=$(mktemp -d)
        printf '#!/bin/sh\nexec g++ "$@" -std=c++20\n' > "$WRAP/g++-cxx20"
        chmod +x "$WRAP/g++-cxx20"
        # CUDA ops where a GPU is present; on a GPU-less build node export FORCE_CUDA=1 (and
        # TORCH_CUDA_ARCH_LIST) to compile them anyway.
        if [ -z "${FORCE_CUDA:-}" ]; then
            FORCE_CUDA=0
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FORCE_CUDA=1; fi
        fi
        (umask 022; CXX="$WRAP/g++-cxx20" MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-2} FORCE_CUDA=$FORCE_CUDA \
            "$VPY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
            -w "$WHEELS" mmcv==2.1.0)
        rm -rf "$WRAP"
        WHEEL=$(find "$WHEELS" -maxdepth 1 -name 'mmcv-2.1.0-*.whl' -print -quit)
        record_hash "$WHEEL"
    fi
    install --no-deps "$WHEEL"
fi
if [ "$WITH_MM" = 1 ]; then
    install -r requirements-mm.txt
fi

# The package itself, editable, so tools/ and the entry points import it from this checkout; its modules compiled
# too (an edited one is recompiled as Python imports it: the bytecode records its source's time and size).
install --no-deps --no-build-isolation -e .
"$VPY" -m compileall -q -j 0 cat tools train_cls.py train_det.py train_seg.py >/dev/null \
    || echo "setup_env.sh: cat's modules could not all be compiled to bytecode here (Python compiles them as it imports them)" >&2

# What was installed, from the packages' records (importing torch to ask would take seconds; the first run imports
# it anyway).
"$VPY" - <<'PY'
from importlib.metadata import version
print(f"cat env ready: torch {version('torch')}, timm {version('timm')}, hydra {version('hydra-core')}")
PY
