"""``just test-quick`` (marker ``quick``, set by tests/conftest.py) stays what it says: the fast
tests of every package, none of the slow ones.

Read from the files and from the marking hook itself, without collecting the suite (that alone
costs 10-15 s here)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parent.parent
#: The packages the suite mirrors (DESIGN 2), and the project-wide checks at the top.
PACKAGES = ("tests/trainer", "tests/engines", "tests/sync", "tests")
_MODULE_MARK = re.compile(r"^pytestmark = .*pytest\.mark\.(slow|vllm)\b", re.MULTILINE)


def _quick_files(package: str) -> list[str]:
    """Test files of ``package`` (its direct files for ``tests``) that can hold quick tests."""
    top = ROOT / package
    files = top.glob("test_*.py") if package == "tests" else top.rglob("test_*.py")
    rel = (f.relative_to(ROOT).as_posix() for f in files)
    return [
        f
        for f in rel
        if f not in conftest.SLOW_FILES and not _MODULE_MARK.search((ROOT / f).read_text())
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_has_tests_in_the_quick_set(package):
    assert len(_quick_files(package)) >= 3, package


def test_every_slow_file_named_exists():
    missing = [f for f in conftest.SLOW_FILES if not (ROOT / f).is_file()]
    assert not missing, f"tests/conftest.py SLOW_FILES names files that are gone: {missing}"


class _Item:
    def __init__(self, nodeid: str, *marks: str) -> None:
        self.nodeid = nodeid
        self.marks = set(marks)

    def get_closest_marker(self, name: str) -> object | None:
        return SimpleNamespace(name=name) if name in self.marks else None

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.marks.add(mark.name)


def test_slow_vllm_and_slow_files_tests_are_left_out_of_the_quick_set_and_the_rest_are_in():
    heavy = conftest.HEAVY_FIRST[0]
    items = [
        _Item("tests/trainer/test_algorithms.py::test_a"),
        _Item("tests/e2e/test_train_cli.py::test_b", "slow"),
        _Item("tests/engines/vllm/test_real_vllm.py::test_c", "vllm"),
        _Item(f"{heavy}::test_d"),
        _Item("tests/sync/test_bracket.py::test_e[x]"),
    ]
    conftest.pytest_collection_modifyitems(None, items)
    quick = [i.nodeid for i in items if "quick" in i.marks]
    assert quick == [
        "tests/trainer/test_algorithms.py::test_a",
        "tests/sync/test_bracket.py::test_e[x]",
    ]


def test_the_justfile_runs_the_quick_set_on_two_workers():
    justfile = (ROOT / "justfile").read_text()
    recipe = justfile.split("\ntest-quick", 1)[1].split("\n\n", 1)[0]
    assert "-m quick" in recipe and "-n 2 --dist loadfile" in recipe
