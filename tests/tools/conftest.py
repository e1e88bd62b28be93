from __future__ import annotations

import runpy
import sys

import pytest

from tests.conftest import REPO


@pytest.fixture
def run_tool(capsys):
    """Run ``tools/<name>.py`` in this process with ``args``; return its stdout."""

    def run(name: str, *args: str, expect: int = 0) -> str:
        argv = sys.argv
        sys.argv = [f"{name}.py", *args]
        try:
            with pytest.raises(SystemExit) as code:
                runpy.run_path(str(REPO / "tools" / f"{name}.py"), run_name="__main__")
        finally:
            sys.argv = argv
        assert code.value.code == expect
        return capsys.readouterr().out

    return run
