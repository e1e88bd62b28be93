"""cat as a library: a wheel built from the repository installs into a fresh virtual environment
(no checkout on the path) and works there; without the OpenMMLab stack, train_det.py/train_seg.py
say in one line how to set it up.

The fresh environment gets its dependencies from this one (the ones setup already downloaded):
a .pth file lists links to this environment's packages, all but the OpenMMLab stack, so the
same venv also shows what a machine without `setup_env.sh --mm` sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, TOY_RUN_S

pytestmark = pytest.mark.slow

MM = ("mmcv", "mmdet", "mmseg", "mmengine", "mmsegmentation", "mmpretrain")

CHECK = r"""
import importlib.metadata as md
import importlib.resources as resources
import os
import sys

from packaging.requirements import Requirement

import cat, timm, torch
from cat.ops import CirculantAttention, circulant_attention

assert not cat.__file__.startswith(os.environ["REPO"]), cat.__file__  # the wheel, not the checkout
assert md.version("cat") == cat.__version__
# The license travels with the wheel: its expression in the metadata, its text among the files.
assert md.metadata("cat")["License-Expression"] == "Apache-2.0", md.metadata("cat")["License-Expression"]
assert any(f.name == "LICENSE" and "Apache License" in f.read_text() for f in md.files("cat")), md.files("cat")
unmet = []
for line in md.requires("cat"):
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        if md.version(req.name) not in req.specifier:
            unmet.append(f"{req.name} {md.version(req.name)} not in {req.specifier}")
assert not unmet, unmet
assert "ca_deit_tiny" in timm.list_models("ca_*") and "ca_pvt_tiny" in timm.list_models("ca_*")
model = timm.create_model("ca_deit_tiny", num_classes=10).eval()
with torch.no_grad():
    assert model(torch.randn(2, 3, 64, 96)).shape == (2, 10)
assert cat.create_model("ca_pvt_tiny", num_classes=3)(torch.randn(1, 3, 64, 64)).shape == (1, 3)
q = k = v = torch.randn(1, 6, 8, 4)
assert circulant_attention(q, k, v).shape == (1, 6, 8, 4)
assert CirculantAttention(16)(torch.randn(1, 48, 16), hw=(6, 8)).shape == (1, 48, 16)
for package, name in (("cat", "paper_tables.yaml"), ("cat.configs", "job.yaml"), ("cat.configs", "logger/wandb.yaml"),
                      ("cat.configs", "hydra/launcher/slurm.yaml")):
    assert resources.files(package).joinpath(name).is_file(), (package, name)
print("wheel OK", cat.__version__)
"""


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    venv = root / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    site = Path(
        subprocess.check_output(
            [venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    deps = root / "deps"  # this environment's packages, but not cat itself nor the OpenMMLab stack
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if name.startswith(("cat", "__editable__", "_cat")) or name.startswith(MM) or name.endswith(".pth"):
            continue
        (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    (whl,) = (root / "dist").glob("cat-*.whl")
    subprocess.run(
        [venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(whl)],
        check=True,
        capture_output=True,
        text=True,
    )
    return venv


def test_wheel_installs_and_works_without_the_checkout(wheel_venv, tmp_path):
    proc = subprocess.run(
        [wheel_venv / "bin/python", "-c", CHECK],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"REPO": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=TOY_RUN_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("wheel OK")


@pytest.mark.parametrize("entry, task", [("train_det.py", "detection"), ("train_seg.py", "segmentation")])
def test_dense_entry_points_without_the_stack_say_how_to_set_it_up(wheel_venv, entry, task):
    proc = subprocess.run(
        [wheel_venv / "bin/python", str(REPO / entry)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {task} needs the OpenMMLab stack (mmengine, mmcv, mm{'det' if task == 'detection' else 'seg'} "
        "not installed); set it up with: bash scripts/setup_env.sh --mm"
    ]


def pinned_versions() -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line in requirements*.txt."""
    pins = {}
    for path in sorted(REPO.glob("requirements*.txt")):
        for line in path.read_text().splitlines():
            spec = line.split("#", 1)[0].strip()
            if "==" in spec:
                name, version = spec.split("==", 1)
                pins[name.strip().lower()] = version.strip()
    return pins


@pytest.mark.skipif(
    not os.environ.get("CI"), reason="CI checks that it runs the pinned set; a developer's venv may differ"
)
def test_ci_runs_the_pinned_set():
    import importlib.metadata as md

    wrong = []
    for name, version in pinned_versions().items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            installed = "missing"
        if installed.split("+")[0] != version:
            wrong.append(f"{name} {installed} (pinned {version})")
    assert not wrong, "requirements*.txt pins what CI tests; installed differently: " + ", ".join(wrong)


@pytest.mark.skipif(
    not os.environ.get("CI"), reason="CI checks the environment its setup made; a developer's venv may differ"
)
@pytest.mark.parametrize("package", ["torch", "timm", "hydra", "mmdet", "cat"])
def test_ci_runs_with_every_package_compiled_by_the_setup(package):
    """scripts/setup_env.sh compiles what it installs (uv leaves packages uncompiled unless told): where bytecode is
    not written back, an uncompiled torch made every new interpreter compile it again (8 s, not 3.6, per process)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed")
    sources = [p for p in Path(spec.origin).parent.rglob("*.py") if "__pycache__" not in p.parts]
    uncompiled = [p for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file() and _compiles(p)]
    assert not uncompiled, (
        f"{len(uncompiled)} of {len(sources)} modules of {package} have no bytecode: {uncompiled[:3]}"
    )


def _compiles(path: Path) -> bool:
    """Whether this interpreter can compile ``path`` (a package may ship a module for newer Pythons only)."""
    try:
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError):
        return False
    return True
