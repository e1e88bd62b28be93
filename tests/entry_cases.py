"""Many command lines of one entry point (``train_cls.py``, ``train_det.py``, ``train_seg.py``) in one
fresh interpreter, each run the way ``python <script> <args>`` runs it: as ``__main__``, with its
own ``sys.argv`` through Hydra's command line, its own stdout and stderr, and its exit status.

A refused run then costs its own work, not an interpreter's imports (≈ 5 s each). The process
boundary itself (signals, exit statuses seen by a shell, the launcher) stays with the subprocess
tests. Run as ``python -m tests.entry_cases CASES.json RESULTS.json``.
"""

from __future__ import annotations

import gc
import io
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from tests import prewarmed

REPO = Path(__file__).resolve().parents[1]


def run_entry_cases(
    script: str, cases: dict[str, list[str]], env: dict[str, str] | None = None, timeout: int = 900
) -> dict[str, subprocess.CompletedProcess]:
    """``{name: CompletedProcess}`` of ``python <script> *cases[name]`` for every case, run in order in
    one interpreter started in the repository with ``env`` added to this one's environment."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, results = Path(tmp) / "cases.json", Path(tmp) / "results.json"
        spec.write_text(json.dumps({"script": str(REPO / script), "cases": cases}))
        proc = prewarmed.run(
            [sys.executable, "-m", "tests.entry_cases", str(spec), str(results)],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0 and results.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
        outcome = json.loads(results.read_text())
    return {
        name: subprocess.CompletedProcess([script, *cases[name]], r["returncode"], r["stdout"], r["stderr"])
        for name, r in outcome.items()
    }


def _run_case(script: str, args: list[str]) -> dict[str, object]:
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [script, *args]
    status = 0
    with redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            status = prewarmed.exit_status(exit_.code, stderr)
        except BaseException:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
            status = 1
    # The next case's entry sets aside what is alive (gc.freeze): this case's leftovers are not, as in a new process.
    gc.collect()
    return {"returncode": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def main(spec_path: str, results_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    results = {name: _run_case(spec["script"], args) for name, args in spec["cases"].items()}
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
