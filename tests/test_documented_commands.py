"""Every command the README, the documentation's pages, the Slurm scripts and the configs' comments show is exercised:
a training command composes to a config that passes the trainer's own check (schema, model at its input size,
optimizer, transform), and a tool's command line parses with the tool's own parser: a user who copies one meets no
error that this repository could have caught. Paths the commands name (datasets,
checkpoints, output folders) are replaced by ones that exist; a multirun's comma lists are expanded into
its cells. The sweep presets' own cells are checked in tests/runtime/test_sweeps.py."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, checked_config

# Where commands are shown: the README's bash blocks, and comment lines of the Slurm scripts and configs.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SOURCES = [*PAGES, *sorted((REPO / "scripts" / "slurm").glob("*.sbatch"))]
SOURCES += sorted((REPO / "configs").rglob("*.yaml"))
# A command line (not prose naming a trainer): it starts with python, torchrun, sbatch or bash.
COMMAND = re.compile(r"^(?:\S*python3?|torchrun|sbatch|bash)\s.*?\btrain_(cls|det|seg)\.py\b(.*)$")
PATH_KEYS = ("data.root", "checkpoint", "model.pretrained", "output_dir")


def _shown_lines(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each line that can show a command, with its continuation lines joined."""
    text = path.read_text()
    if path.suffix == ".md":
        spans = [m.span(1) for m in re.finditer(r"```bash\n(.*?)```", text, re.S)]
    else:
        spans = [(0, len(text))]
    lines = []
    for start, end in spans:
        pending: list[str] = []
        for number, line in enumerate(text[start:end].splitlines(), text.count("\n", 0, start) + 1):
            if not pending:
                first = number
            pending.append(line if path.suffix == ".md" else line.lstrip("# "))
            if pending[-1].endswith("\\"):  # continued on the next line
                pending[-1] = pending[-1][:-1]
            else:
                lines.append((first, " ".join(pending)))
                pending = []
    return lines


def _commands() -> list[tuple[str, str, list[str]]]:
    """(where, task, overrides) of every command shown."""
    found = []
    for path in SOURCES:
        for number, line in _shown_lines(path):
            match = COMMAND.match(line.strip())
            if match is None:
                continue
            words = shlex.split(match.group(2), comments=True)
            words = words[: words.index("&&")] if "&&" in words else words
            found.append((f"{path.relative_to(REPO)}:{number}", match.group(1), [w for w in words if w != "-m"]))
    return found


def _cells(overrides: list[str], stand_in: Path) -> list[list[str]]:
    """A multirun's cells (its comma lists expanded), with every path key pointing into ``stand_in``."""
    axes = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in PATH_KEYS:
            stand_ins = {"checkpoint": "checkpoint.pth", "model.pretrained": "checkpoint.pth", "output_dir": "run"}
            value = str(stand_in / stand_ins.get(key, "folder"))
        values = value.split(",") if "," in value and not re.search(r"[\[{(]", value) else [value]
        axes.append([f"{key}={v}" for v in values])
    return [[*cell, "logger.wandb.mode=disabled"] for cell in itertools.product(*axes)]


COMMANDS = _commands()


def test_the_commands_are_found():
    """The extraction itself: the README's main job, a sweep, detection and segmentation are among them."""
    shown = {(task, " ".join(words)) for _, task, words in COMMANDS}
    assert ("cls", "") in shown and len(COMMANDS) >= 15
    assert any(task == "cls" and "hydra/launcher=submitit_local" in words for task, words in shown)
    assert {task for task, _ in shown} == {"cls", "det", "seg"}


@pytest.mark.parametrize(("where", "task", "overrides"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_passes_its_check(where, task, overrides, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "checkpoint.pth").write_bytes(b"")
    for cell in _cells(overrides, tmp_path):
        checked_config(task, *cell)  # ConfigError names each problem


# A tool's command line in a page: python tools/NAME.py ARGS (a tool's path or the shell's && ends it).
TOOL = re.compile(r"^(?:\S*python3?)\s+tools/(\w+)\.py\b(.*)$")


def _tool_commands() -> list[tuple[str, str, list[str]]]:
    """(where, tool, arguments) of every tool command the pages show."""
    found = []
    for path in PAGES:
        for number, line in _shown_lines(path):
            for part in line.split("&&"):
                match = TOOL.match(part.strip())
                if match is not None:
                    words = shlex.split(match.group(2), comments=True)
                    found.append((f"{path.relative_to(REPO)}:{number}", match.group(1), words))
    return found


TOOL_COMMANDS = _tool_commands()


class _Parsed(Exception):
    """Raised where the tool's parser returns: its arguments parsed, and nothing of the tool ran."""


def test_the_tool_commands_are_found():
    assert {"predict", "benchmark", "make_tables", "make_toy_coco", "flops"} <= {t for _, t, _ in TOOL_COMMANDS}


@pytest.mark.parametrize(("where", "tool", "arguments"), TOOL_COMMANDS, ids=[c[0] for c in TOOL_COMMANDS])
def test_documented_tool_command_parses(where, tool, arguments, monkeypatch, capsys):
    """The tool's own argparse parser takes the arguments as shown (run as ``__main__`` up to its parser)."""
    import argparse
    import runpy
    import sys

    import torch

    if "cuda" in arguments and not torch.cuda.is_available():
        pytest.skip("a CUDA command: its --device is checked against the machine's devices")
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"{tool}.py", *arguments])
    with pytest.raises(_Parsed):
        runpy.run_path(str(REPO / "tools" / f"{tool}.py"), run_name="__main__")
