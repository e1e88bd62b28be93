"""A failed command's own last lines in the test's failure: a test that runs a command with ``check=True`` (or a
``timeout``) fails with :class:`subprocess.CalledProcessError` (or ``TimeoutExpired``), whose message is only
"returned non-zero exit status 1"; the one line the command printed saying why is in the exception's captured
output, which pytest does not show. This hook adds the end of that output as a section of the failure report,
wherever in ``tests/`` the command ran (``tests/conftest.py`` imports it)."""

from __future__ import annotations

import subprocess
from collections.abc import Generator, Iterator

import pytest

TAIL_CHARS = 3000  # the end of each stream: the command's last lines, where a script says why it stopped


def _text(stream: str | bytes | None) -> str:
    if stream is None:
        return ""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream


def failed_commands(error: BaseException | None) -> Iterator[subprocess.CalledProcessError | subprocess.TimeoutExpired]:
    """The failed commands in ``error`` and the exceptions it was raised from or during, outermost first."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, subprocess.CalledProcessError | subprocess.TimeoutExpired):
            yield error
        error = error.__cause__ or error.__context__


def output_tail(error: subprocess.CalledProcessError | subprocess.TimeoutExpired | subprocess.CompletedProcess) -> str:
    """What the command printed, each stream's end, or a line saying it was not captured (also a finished
    command's, for an assertion's message: ``assert proc.returncode == 0, output_tail(proc)``)."""
    parts = []
    for name, stream in (("stdout", error.stdout), ("stderr", error.stderr)):
        text = _text(stream).rstrip()
        if text:
            cut = "…" if len(text) > TAIL_CHARS else ""
            parts.append(f"--- {name} (its end) ---\n{cut}{text[-TAIL_CHARS:]}")
    args = error.args if isinstance(error, subprocess.CompletedProcess) else error.cmd
    command = args if isinstance(args, str) else " ".join(map(str, args))
    head = f"$ {command[:500]}"
    return "\n".join([head, *parts]) if parts else f"{head}\n(its output was not captured: it went to the console)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.excinfo is not None:
        for error in failed_commands(call.excinfo.value):
            report.sections.append((f"output of the failed command ({call.when})", output_tail(error)))
    return report
