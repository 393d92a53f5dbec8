"""The docs cannot silently go stale: the config reference, the fault reference's operations
and the README's two commands.

The key reference in docs/configuration.md is generated from the config tree; regenerate it
after changing a key, its default, type or doc::

    .venv/bin/python -m tests.test_docs --write
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any

import attrs

from trainer.config import Config
from trainer.config._load import iter_fields, type_name

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"
BEGIN = "<!-- BEGIN GENERATED: .venv/bin/python -m tests.test_docs --write -->"
END = "<!-- END GENERATED -->"
README_COMMANDS = [
    "bash setup.sh && .venv/bin/just run",
    "bash setup.sh && .venv/bin/just test",
]
REGENERATE = "regenerate it: .venv/bin/python -m tests.test_docs --write"

_ROW = re.compile(r"^\| `(?P<key>[\w.]+)` \| `(?P<default>.*?)` \|")


def _default(key: str) -> Any:
    obj: Any = Config()
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section_docs(cls: type = Config, prefix: str = "") -> dict[str, str]:
    """Dotted section name -> its doc, for every section (nested ones too)."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for a in attrs.fields(cls):
        if attrs.has(hints[a.name]):
            out[prefix + a.name] = a.metadata.get("doc", "")
            out |= _section_docs(hints[a.name], prefix + a.name + ".")
    return out


def reference_markdown() -> str:
    """Every key of the config tree as markdown tables, one per top-level section."""
    sections = _section_docs()
    tables: dict[str, list[str]] = {}
    for key, a, tp in iter_fields():
        section = key.split(".")[0] if "." in key else key
        env = a.metadata.get("env")
        doc = a.metadata.get("doc", "") + (f" Env `{env}` overrides it." if env else "")
        doc = _cell(doc).replace("<", "&lt;").replace(">", "&gt;")
        tables.setdefault(section, []).append(
            f"| `{key}` | `{_cell(repr(_default(key)))}` | `{_cell(type_name(tp))}` | {doc} |"
        )
    parts = []
    for section, rows in tables.items():
        title = f"### `{section}`"
        doc = sections.get(section, "")
        subs = [
            f"`{name}`: {sdoc}" for name, sdoc in sections.items() if name.startswith(section + ".")
        ]
        intro = " ".join(filter(None, [doc, *subs]))
        parts.append(
            "\n".join(
                [
                    title,
                    "",
                    *([intro, ""] if intro else []),
                    "| key | default | type | doc |",
                    "|---|---|---|---|",
                    *rows,
                ]
            )
        )
    return "\n\n".join(parts) + "\n"


def _generated_block(text: str) -> str:
    assert BEGIN in text and END in text, f"{CONFIG_DOC} lost its generated-section markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def write_reference() -> None:
    text = CONFIG_DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    CONFIG_DOC.write_text(f"{head}{BEGIN}\n\n{reference_markdown()}\n{END}{tail}")


def test_every_config_key_is_in_the_configuration_reference():
    text = CONFIG_DOC.read_text()
    missing = [key for key, _a, _tp in iter_fields() if f"`{key}`" not in text]
    assert not missing, f"docs/configuration.md does not document {missing}; {REGENERATE}"


def test_configuration_reference_defaults_match_the_config_and_list_no_removed_keys():
    documented = {
        m["key"]: m["default"].replace("\\|", "|")
        for line in _generated_block(CONFIG_DOC.read_text()).splitlines()
        if (m := _ROW.match(line))
    }
    current = {key: repr(_default(key)) for key, _a, _tp in iter_fields()}
    removed = sorted(set(documented) - set(current))
    assert not removed, (
        f"docs/configuration.md documents keys that no longer exist: {removed}; {REGENERATE}"
    )
    stale = {
        k: (documented[k], v) for k, v in current.items() if k in documented and documented[k] != v
    }
    assert not stale, f"docs/configuration.md has stale defaults (doc, code): {stale}; {REGENERATE}"


def test_readme_opens_with_exactly_the_two_fresh_machine_commands():
    text = README.read_text()
    first_block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert first_block is not None, "README.md has no code block"
    lines = [line.strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert lines == README_COMMANDS
    # right after the title and one sentence: nothing but prose comes before the block
    before = text[: first_block.start()].strip().splitlines()
    assert before[0].startswith("# ") and len([ln for ln in before[1:] if ln.strip()]) == 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference()
        print(f"wrote the key reference into {CONFIG_DOC}")
    else:
        print(reference_markdown(), end="")


def test_the_fault_reference_lists_every_operation_a_fault_can_target():
    from trainer.vocabulary import OPERATIONS

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    entry = text.split("- **OP** —", 1)[1].split("- **ACTION** —", 1)[0]
    assert sorted(set(re.findall(r"`(/?[a-z0-9_/]+)`", entry))) == sorted(OPERATIONS)


_PRIVATE_MODULE = re.compile(r"\b(?:trainer|engines|sync)(?:\.[a-z]\w*)*\._[a-z]\w*")


def test_user_docs_name_only_public_modules():
    """A user's page names what they may import; private modules (``trainer.config._load``)
    belong to docs/architecture.md, the map of the code, only."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for page in pages
        if page.name != "architecture.md"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in _PRIVATE_MODULE.finditer(line)
    ]
    assert found == []
