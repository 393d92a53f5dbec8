"""docs/architecture.md stays true: its import graph is the code's, and its table of
trainer's packages names every module of each."""

from __future__ import annotations

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
