"""The documentation cannot drift from the code: the README leads to each task within its first 300 lines, the tables
that restate the code are the code's (tests/doc_tables.py renders them), every qualified name a page gives exists,
no page tells the history of its numbers, and the site builds with MkDocs in strict mode, which a broken link or
anchor fails."""

from __future__ import annotations

import html
import importlib
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.doc_tables import paper_rows_table, recipe_cost_table, recipe_epochs, zoo_table

README = REPO / "README.md"
PAGES = [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
TOP_PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]  # docs/perf/ holds the dated logs: history by design


def test_the_readme_leads_to_each_task_within_its_first_300_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    head = "\n".join(lines[:300])
    tasks = {
        "try a model": "tools/predict.py photo.jpg --model ca_deit_small --pretrained",
        "train CA-DeiT-S on ImageNet on 8 GPUs": "torchrun --nproc_per_node=8 train_cls.py experiment=ca_deit_s",
        "evaluate a released checkpoint": "train_cls.py experiment=ca_deit_s mode=eval",
        "Mask R-CNN with a CA-Swin backbone": "train_det.py experiment=mask_rcnn_ca_swin_t_1x",
        "circulant attention in one's own timm model": "cat.convert(model)",
        "submit to Slurm": "sbatch --partition=gpu --account=my_lab scripts/slurm/single_node.sbatch",
    }
    missing = [task for task, command in tasks.items() if command not in head]
    assert not missing, missing


def test_the_readmes_python_runs_as_written():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None
    namespace: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert tuple(namespace["y"].shape) == (2, 196, 192)


def test_the_model_zoo_is_the_codes():
    assert zoo_table() in README.read_text()


@pytest.mark.parametrize("number", [3, 4, 5])
def test_the_reproducing_pages_tables_are_the_papers(number):
    assert paper_rows_table(number) in (REPO / "docs" / "reproducing.md").read_text()


def test_the_recipe_cost_table_is_derived_from_the_measured_step_and_the_presets():
    """docs/reproducing.md's estimate: the one measured GPU step scaled by GFLOPs, over each preset's epochs."""
    assert recipe_cost_table(recipe_epochs()) in (REPO / "docs" / "reproducing.md").read_text()


def test_the_models_pages_parameter_counts_are_the_models():
    import cat
    from cat.models import on_meta

    text = (REPO / "docs" / "models.md").read_text()
    rows = re.findall(r"^\| `(\w+)`(?: \(timm\))? \| ([\d,]+) \| ([\d.]+) \|", text, re.M)
    assert len(rows) >= 6
    for name, params, _ in rows:
        with on_meta():
            model = cat.create_model(name)
        assert sum(p.numel() for p in model.parameters()) == int(params.replace(",", "")), name


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def _logger_names() -> set[str]:
    """The loggers cat names (``cat.train``...): a page may name them too."""
    text = "\n".join(p.read_text() for p in (REPO / "cat").rglob("*.py"))
    return set(re.findall(r'"(cat\.\w+)"', text))


def test_every_qualified_name_a_page_gives_exists():
    """``cat.ops.X`` in any page, the dated logs and the changelog included, is in the package as named."""
    loggers = _logger_names()
    stale = []
    for page in PAGES:
        for name in re.findall(r"`(cat(?:\.[A-Za-z_]\w*)+)", page.read_text()):
            if name not in loggers and not _resolves(name):
                stale.append(f"{page.relative_to(REPO)}: {name}")
    assert not stale, stale
    assert not _resolves("cat.ops.fused.GROUP_FLOATS") and not _resolves("cat.ops.LEAN_AUTO_MIN_FLOATS")


# How timing history reads: the wording of earlier measurements, days and cuts, issue numbers.
HISTORY = re.compile(
    r"earlier (the same|that) day|before the last cut|the last cut|issue \d+|issue's note|re-?measured"
    r"|over the last \w+ (such )?clones|on 20\d\d-\d\d-\d\d:",
    re.I,
)


@pytest.mark.parametrize("page", TOP_PAGES, ids=[str(p.relative_to(REPO)) for p in TOP_PAGES])
def test_no_page_tells_the_history_of_its_numbers(page):
    text = page.read_text()
    assert not HISTORY.findall(text) and not ATTEMPTS.findall(text)


# How the work was arranged, which no page of the project's speaks of: the tracker, the change, the machines lent.
PROCESS = re.compile(
    r"issues show|this change|this session|a session was|no (?:GPU|device) (?:was )?lent|had no GPU", re.I
)
# Attempt diaries belong to no page a reader starts from (the dated logs may number their experiments).
ATTEMPTS = re.compile(r"\battempts? \d+", re.I)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_no_page_speaks_of_the_work_instead_of_the_project(page):
    assert not PROCESS.findall(page.read_text())


def test_the_page_checks_find_what_they_forbid():
    assert PROCESS.findall("see `issues show 56`; before this change, on this session's machine") == [
        "issues show",
        "this change",
        "this session",
    ]
    assert ATTEMPTS.findall("docs/perf.md, attempts 20-21") == ["attempts 20"]


def _site(tmp_path: Path) -> Path:
    """A copy of the documentation, its config pointed at this checkout's package, to build in ``tmp_path``."""
    pytest.importorskip("mkdocs", reason="MkDocs not installed (bash scripts/setup_env.sh --dev)")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config["plugins"][1]["mkdocstrings"]["handlers"]["python"]["paths"] = [str(REPO)]
    config["site_dir"] = str(tmp_path / "site")
    config["hooks"] = [str(REPO / hook) for hook in config.get("hooks", [])]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return tmp_path / "mkdocs.yml"


def ci_build_flags() -> list[str]:
    """The flags .ci/run builds the site with (its documentation gate), less where the site goes: the gate a change
    meets is what this file tests, so a flag that hides warnings there (``--quiet``, which drops them before
    ``--strict`` counts them) fails here too."""
    line = next(line for line in (REPO / ".ci" / "run").read_text().splitlines() if "mkdocs build " in line)
    words = shlex.split(line.split("mkdocs build ", 1)[1])
    flags = []
    for word in words:
        if flags and flags[-1] in ("--site-dir", "-d"):
            flags.pop()  # and its value
            continue
        flags.append(word)
    return flags


def _build(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", *ci_build_flags(), "--config-file", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


def test_the_site_builds_strictly_and_a_broken_link_or_anchor_fails_it(tmp_path):
    """Built as .ci/run builds it: the site builds, and a planted broken link or anchor fails the build."""
    assert "--strict" in ci_build_flags() and "--quiet" not in ci_build_flags() and "-q" not in ci_build_flags()
    config = _site(tmp_path)
    built = _build(config)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "circulant_attention" in api
    raw_roles = re.findall(r":(?:func|class|mod|meth|attr|data|obj|exc|const):", api)
    assert not raw_roles and "<code>cat.ops.policy.kernel_for</code>" in api, raw_roles[:5]
    # The home page stands alone: the README's quick start, zoo and citation, copied in at build time.
    home = (tmp_path / "site" / "index.html").read_text()
    assert "bash scripts/setup_env.sh && .venv/bin/python train_cls.py" in html.unescape(re.sub(r"<[^>]+>", "", home))
    zoo_names = re.findall(r"^\| [^|]+ \| `(\w+)` \|", README.read_text(), re.MULTILINE)
    assert len(zoo_names) >= 14 and all(f"<code>{name}</code>" in home for name in zoo_names)
    assert "han2026circulant" in home and 'id="model-zoo"' in home
    for planted, named in (
        ("[the zoo](zoo.md)", "zoo.md"),
        ("[levels](models.md#no-such-section)", "no-such-section"),
    ):
        page = tmp_path / "docs" / "install.md"
        page.write_text((REPO / "docs" / "install.md").read_text() + f"\nSee {planted}.\n")
        broken = _build(config)
        assert broken.returncode != 0 and named in broken.stderr, broken.stderr[-3000:]


def test_the_classification_pages_record_keys_are_the_metrics():
    """Every evaluation metric (declared once, ``EVAL_METRICS``) is in the page's table of a run's records, under
    each split that records it."""
    from cat.classification.metrics import EVAL_METRICS

    text = (REPO / "docs" / "classification.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `metrics.json"))
    missing = [
        f"{split}/{m.name}" for m in EVAL_METRICS for split in ("val", "eval") if f"`{split}/{m.name}`" not in table
    ]
    assert not missing, missing
