"""Where the suite's CPU goes, test by test: ``python -m pytest -p tests.cpu_time`` ends with each test's CPU-seconds
(its own, in the pytest process that ran it, and its commands' that it waited for) beside the wall-clock
``--durations``, the totals by tier, and the tests that took the most. On 2 cores the suite is bound by the CPU, so
this, not the wall clock of one test among three workers, says what a change to a test saves.

The commands a test waits for include those :mod:`tests.prewarmed` forks for it (their CPU time comes back with
their exit status). A command a test does not wait for itself is not counted: Slurm's jobs and daemons, torchrun's
workers (forked through the server's shim), and Inductor's compile workers, whose C++ compilers count to the test
that ends their pool. ``/usr/bin/time`` on the whole command gives the run's total; the difference is theirs.
``CAT_TEST_CPU_TOP=N`` lists the N costliest tests (15 by default)."""

from __future__ import annotations

import os
import resource
from collections.abc import Generator

import pytest

from tests import prewarmed

# How many of the costliest tests the summary lists (a number at least the test count lists every one).
TOP = int(os.environ.get("CAT_TEST_CPU_TOP", "15"))
_START = pytest.StashKey[tuple[float, float]]()
_rows: list[tuple[float, float, bool, str]] = []  # (own, waited commands', slow, test) as the reports arrive


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _waited_cpu_seconds() -> float:
    """The commands this process waited for: its children's and those the prewarmed server forked for it."""
    return _cpu_seconds(resource.RUSAGE_CHILDREN) + prewarmed.forked_cpu_s


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    item.stash[_START] = (_cpu_seconds(resource.RUSAGE_SELF), _waited_cpu_seconds())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, None, None]:
    outcome = yield
    if call.when == "teardown" and _START in item.stash:  # setup, call and teardown: the test's whole cost
        own, children = item.stash[_START]
        # On the report, so that it reaches pytest-xdist's controller from the worker that ran the test.
        outcome.get_result().user_properties += [
            ("cpu_own_s", _cpu_seconds(resource.RUSAGE_SELF) - own),
            ("cpu_waited_s", _waited_cpu_seconds() - children),
        ]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    if report.when == "teardown" and "cpu_own_s" in properties:
        _rows.append((properties["cpu_own_s"], properties["cpu_waited_s"], "slow" in report.keywords, report.nodeid))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _rows or hasattr(terminalreporter.config, "workerinput"):  # a pytest-xdist worker's went to the controller
        return
    write = terminalreporter.write_line
    terminalreporter.section("CPU-seconds by test (own + commands waited for)")
    own, waited = sum(row[0] for row in _rows), sum(row[1] for row in _rows)
    write(f"{own + waited:.1f} s in {len(_rows)} tests: {own:.1f} own, {waited:.1f} in commands they waited for")
    for slow in (False, True):
        tier = [row[0] + row[1] for row in _rows if row[2] is slow]
        write(f"  {'end-to-end (slow)' if slow else 'quick'}: {sum(tier):.1f} s in {len(tier)} tests")
    for row_own, row_waited, _, nodeid in sorted(_rows, key=lambda row: row[0] + row[1], reverse=True)[:TOP]:
        write(f"{row_own + row_waited:8.1f} s  ({row_own:.2f} + {row_waited:.2f})  {nodeid}")
