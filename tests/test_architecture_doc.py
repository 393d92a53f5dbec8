"""docs/architecture.md stays true: its import graph is the code's, its table of trainer's
packages names every module of each, and every owner its decisions table names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
#: The doc's units: trainer's packages and top-level modules, then engines and sync whole.
UNITS = [
    *(
        f"trainer.{p.stem if p.suffix else p.name}"
        for p in sorted((ROOT / "trainer").iterdir())
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    ),
    "engines",
    "sync",
]


def _unit(module: str) -> str | None:
    return next((u for u in UNITS if module == u or module.startswith(u + ".")), None)


def code_edges() -> set[tuple[str, str]]:
    graph = grimp.build_graph("trainer", "engines", "sync")
    edges = set()
    for module in graph.modules:
        a = _unit(module)
        for imported in graph.find_modules_directly_imported_by(module):
            b = _unit(imported)
            if a and b and a != b:
                edges.add((a.removeprefix("trainer."), b.removeprefix("trainer.")))
    return edges


def doc_edges(text: str) -> set[tuple[str, str]]:
    block = re.search(r"```imports\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```imports block"
    edges = set()
    for line in block.group(1).splitlines():
        source, _, targets = line.partition(" -> ")
        edges |= {(source.strip(), t.strip()) for t in targets.split(",")}
    return edges


def test_the_documented_import_graph_is_the_codes():
    documented, actual = doc_edges(DOC.read_text()), code_edges()
    assert actual - documented == set(), "imports the doc does not draw (add them to it)"
    assert documented - actual == set(), "edges the doc draws that the code no longer has"


def test_the_packages_table_names_every_module_of_each_package():
    text = DOC.read_text()
    for package in sorted(p for p in (ROOT / "trainer").iterdir() if (p / "__init__.py").exists()):
        row = next(
            (r for r in text.splitlines() if r.startswith(f"| `trainer.{package.name}` |")), None
        )
        assert row, f"no row for trainer.{package.name} in the packages table"
        for module in sorted(package.glob("*.py")):
            if module.stem != "__init__":
                assert f"`{module.stem}`" in row, (
                    f"trainer.{package.name}.{module.stem} is not named"
                )


def test_the_top_level_modules_are_named():
    text = DOC.read_text()
    line = next(p for p in text.split("\n\n") if p.startswith("`trainer`'s top level holds"))
    modules = sorted(p.stem for p in (ROOT / "trainer").glob("*.py"))
    assert all(f"`{m}`" in line for m in modules), modules
    assert len(modules) <= 8  # issue 30: the top level stays small


def test_the_check_can_fail():
    """An edge missing from the block, or one too many, is seen."""
    text = DOC.read_text()
    actual = code_edges()
    assert (
        doc_edges(text.replace(", sync, vocabulary, workers\n", ", vocabulary, workers\n", 1))
        != actual
    )
    assert doc_edges(text.replace("checkpoint -> errors", "checkpoint -> errors, loop")) != actual


def _resolves(name: str) -> bool:
    """Whether dotted ``name`` is a module of the house, or an attribute path inside one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def owner_names(text: str) -> list[str]:
    """The dotted names of the house in the owner column of "One decision, one owner"."""
    section = text.split("## One decision, one owner", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    names = []
    for row in rows[1:]:  # after the header
        owner = row.rstrip(" |").rsplit(" | ", 1)[1]
        names += re.findall(r"`((?:trainer|engines|sync)\.[\w.]+)`", owner)
    return names


def test_every_owner_the_decisions_table_names_exists():
    """Each decision's owner, as the table names it, is a module or an attribute of one: a
    rename or a move that leaves the table behind fails here."""
    names = owner_names(DOC.read_text())
    assert len(names) >= 20
    missing = [n for n in names if not _resolves(n)]
    assert missing == []
    assert not _resolves("trainer.config.plan_runs")  # the check can fail
