"""How an entry point starts: its imports out of the cyclic garbage collector's way (cat/runtime/entry.py)."""

from __future__ import annotations

import ast
import json
import sys

import pytest

from tests import prewarmed
from tests.conftest import REPO
from tests.subprocess_output import output_tail

ENTRY_SCRIPTS = ("train_cls.py", "train_det.py", "train_seg.py")

APP = """
import gc, json
gc.disable()  # as the entry scripts do
import cat.classification.schema  # registers the "cls" schema
from cat.runtime import hydra_entry

made_before = [[] for _ in range(1000)]

@hydra_entry(".", schema="cls")
def main(cfg):
    walked = {id(o) for o in gc.get_objects()}  # what the collector still walks: not the frozen
    with open("seen.json", "w") as seen:
        json.dump({"enabled": gc.isenabled(), "walked": sum(id(o) in walked for o in made_before)}, seen)

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_an_entry_script_turns_the_collector_off_before_its_first_import(script):
    body = ast.parse((REPO / script).read_text()).body[1:]  # after the docstring
    body = [node for node in body if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert ast.unparse(body[0]) == "import gc" and ast.unparse(body[1]) == "gc.disable()", ast.unparse(body[1])
    assert any(isinstance(node, ast.Import | ast.ImportFrom) for node in body[2:])  # imports follow it


def test_an_entry_runs_its_task_with_the_collector_on_and_what_was_made_before_set_aside(tmp_path):
    """The collector is back on when the task runs, and what the process made before the entry (its imports; here
    a thousand lists) is frozen: later full collections do not walk it. (In a process of its own: Hydra sets up
    the logging of the process it runs in.)"""
    (tmp_path / "config.yaml").write_text("hydra:\n  output_subdir: null\n  run:\n    dir: .\n")
    (tmp_path / "app.py").write_text(APP)
    proc = prewarmed.run([sys.executable, str(tmp_path / "app.py")], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, output_tail(proc)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"enabled": True, "walked": 0}
