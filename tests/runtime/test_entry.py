"""How an entry point starts: its imports out of the cyclic garbage collector's way (cat/runtime/entry.py)."""

from __future__ import annotations

import ast
import gc
import json
import runpy
import sys

import pytest

from tests.conftest import REPO

ENTRY_SCRIPTS = ("train_cls.py", "train_det.py", "train_seg.py")

APP = """
import gc, json
import cat.classification.schema  # registers the "cls" schema
from cat.runtime import hydra_entry

@hydra_entry(".", schema="cls")
def main(cfg):
    with open("seen.json", "w") as seen:
        json.dump({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}, seen)

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_an_entry_script_turns_the_collector_off_before_its_first_import(script):
    body = ast.parse((REPO / script).read_text()).body[1:]  # after the docstring
    body = [node for node in body if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert ast.unparse(body[0]) == "import gc" and ast.unparse(body[1]) == "gc.disable()", ast.unparse(body[1])
    assert any(isinstance(node, ast.Import | ast.ImportFrom) for node in body[2:])  # imports follow it


def test_an_entry_runs_its_task_with_the_collector_on_and_what_was_made_before_set_aside(tmp_path, monkeypatch):
    """The collector is back on when the task runs, and what the process made before the entry (its imports; here
    a thousand lists) is frozen: later full collections do not walk it."""
    (tmp_path / "config.yaml").write_text("hydra:\n  output_subdir: null\n  run:\n    dir: .\n")
    (tmp_path / "app.py").write_text(APP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["app.py"])
    was_enabled, frozen_before = gc.isenabled(), gc.get_freeze_count()
    made_before = [[] for _ in range(1000)]
    gc.disable()
    try:
        runpy.run_path(str(tmp_path / "app.py"), run_name="__main__")
    finally:
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["enabled"] and seen["frozen"] >= frozen_before + len(made_before)
