"""The end of a test run says where its time went: the slowest files, and each test over the
per-test budget by name (tests/conftest.py's ``pytest_terminal_summary``)."""

from __future__ import annotations

from types import SimpleNamespace

from tests import conftest


class Reporter:
    def __init__(self, reports: list[SimpleNamespace]) -> None:
        self.stats = {"passed": reports}
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title}")

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def _report(nodeid: str, when: str, seconds: float) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=seconds)


def test_the_slowest_files_and_the_tests_over_budget_are_listed(monkeypatch):
    monkeypatch.setattr(conftest, "TEST_BUDGET_S", 10.0)
    reporter = Reporter(
        [
            _report("tests/a.py::slow", "setup", 4.0),
            _report("tests/a.py::slow", "call", 7.0),  # 11 s with its setup: over 10 s
            _report("tests/a.py::quick", "call", 1.0),
            _report("tests/b.py::t", "call", 9.0),
            SimpleNamespace(nodeid="tests/b.py", duration=99.0),  # a collect report: no `when`
        ]
    )
    conftest.pytest_terminal_summary(reporter, 0, None)
    assert reporter.lines == [
        f"== slowest {conftest.SLOWEST_FILES} test files (sum of their tests)",
        "    12.0s tests/a.py",
        "     9.0s tests/b.py",
        "    21.0s in all, 2 files",
        "== tests over the 10s per-test budget",
        "    11.0s tests/a.py::slow",
    ]


def test_nothing_is_listed_when_no_test_ran():
    reporter = Reporter([])
    conftest.pytest_terminal_summary(reporter, 5, None)
    assert reporter.lines == []
