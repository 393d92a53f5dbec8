"""What the user docs tell people to type: shell commands, transcripts, links and env names.

Sources are ``README.md``, ``docs/*.md`` and ``examples/*.py``. In markdown a command is a line
of a fenced block whose language is ``bash``/``sh``/``shell``, or an inline code span that
starts like a command (``.venv/bin/...``, ``python ...``, ``bash ...``, ``just ...``). A block
opened as ```` ```bash quick ```` is *quick*: ``tests/test_doc_commands.py`` runs its
commands for real, in order. A transcript is a line ``$ COMMAND`` in any other block, followed
by the output it documents. In ``examples/*.py`` a command is a docstring or comment line that
starts like one. Continuation lines (``\\``) are joined and heredoc bodies skipped.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"bash", "sh", "shell"}
#: How an inline code span or an example's line must start to be read as a command.
COMMAND_START = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S+\s+)*(?:\.venv/bin/|python3?\s|bash\s|just\s)")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+)(?P<info>.*)$")
_INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\((?P<target>[^)\s]+)\)")
_HEREDOC = re.compile(r"<<-?\s*'?\"?(?P<tag>\w+)'?\"?")


@attrs.frozen
class Command:
    """One command as the docs spell it, with where it is written."""

    #: The command line, continuations joined.
    text: str
    #: File (relative to the repository root) and 1-based line of its first line.
    where: str
    #: From a ```` ```bash quick ```` block: run for real by the docs test.
    quick: bool = False

    def argv(self) -> list[str]:
        """The words after shell quoting, comments dropped."""
        return shlex.split(self.text, comments=True)


@attrs.frozen
class Transcript:
    """A documented ``$ COMMAND`` and the lines of output shown under it."""

    command: Command
    output: tuple[str, ...]


@attrs.frozen
class Block:
    """A fenced code block: its language, the words after it, first line number and lines."""

    lang: str
    flags: tuple[str, ...]
    line: int
    lines: tuple[str, ...]


def doc_files() -> list[Path]:
    """Every user-facing markdown file: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def example_files() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.py"))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(text: str) -> Iterator[Block]:
    """Fenced code blocks (```` ``` ```` at any indentation), closed by the same fence."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        words = m["info"].split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != m["fence"]:
            body.append(
                lines[j][len(m["indent"]) :] if lines[j].startswith(m["indent"]) else lines[j]
            )
            j += 1
        yield Block(words[0] if words else "", tuple(words[1:]), i + 1, tuple(body))
        i = j + 1


def prose(text: str) -> str:
    """The text outside fenced blocks (fenced lines blanked, so line numbers still count)."""
    lines = text.splitlines()
    inside = None
    for n, line in enumerate(lines):
        m = _FENCE.match(line)
        if inside is None and m:
            inside = m["fence"]
            lines[n] = ""
        elif inside is not None:
            if line.strip() == inside:
                inside = None
            lines[n] = ""
    return "\n".join(lines)


def join_lines(lines: list[str] | tuple[str, ...], first: int) -> Iterator[tuple[int, str]]:
    """(line number, command) for shell lines: continuations joined, heredoc bodies skipped."""
    i = 0
    while i < len(lines):
        start, line = first + i, lines[i].rstrip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        heredoc = _HEREDOC.search(line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc["tag"]:
                i += 1
            i += 1
        if line.strip() and not line.strip().startswith("#"):
            yield start, line.strip()


def _inline_commands(text: str, where: str) -> Iterator[Command]:
    flat = prose(text)
    for m in _INLINE.finditer(flat.replace("\n", " ")):
        span = m.group(1).strip()
        if COMMAND_START.match(span):
            line = flat.count("\n", 0, m.start()) + 1
            yield Command(span, f"{where}:{line}")


def commands(path: Path) -> Iterator[Command]:
    """Every command in one file (shell blocks, inline spans; example docstrings/comments)."""
    text = path.read_text()
    where = rel(path)
    if path.suffix == ".py":
        lines = [re.sub(r"^\s*#\s?", "", ln) for ln in text.splitlines()]
        for n, line in join_lines(lines, 1):
            if COMMAND_START.match(line):
                yield Command(line, f"{where}:{n}")
        return
    for block in blocks(text):
        if block.lang in SHELL_LANGS:
            for n, line in join_lines(block.lines, block.line + 1):
                yield Command(line, f"{where}:{n}", quick="quick" in block.flags)
    yield from _inline_commands(text, where)


def transcripts(path: Path) -> Iterator[Transcript]:
    """``$ COMMAND`` lines of non-shell blocks, each with the output lines under it."""
    for block in blocks(path.read_text()):
        if block.lang in SHELL_LANGS:
            continue
        for i, line in enumerate(block.lines):
            if not line.startswith("$ "):
                continue
            output = []
            for after in block.lines[i + 1 :]:
                if after.startswith("$ "):
                    break
                output.append(after)
            cmd = Command(line[2:].strip(), f"{rel(path)}:{block.line + 1 + i}")
            yield Transcript(cmd, tuple(output))


def links(path: Path) -> Iterator[tuple[str, str]]:
    """(target, where) of every markdown link and image outside code."""
    flat = prose(path.read_text())
    flat = _INLINE.sub(lambda m: " " * len(m.group(0)), flat)
    for m in _LINK.finditer(flat):
        yield m["target"], f"{rel(path)}:{flat.count(chr(10), 0, m.start()) + 1}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeats get GitHub's -1, -2 suffixes)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def env_names(path: Path) -> set[str]:
    """``TRAINER_*`` names a file mentions anywhere."""
    return set(re.findall(r"\bTRAINER_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))


def shown_files() -> set[str]:
    """Files the docs show in full for the reader to save: blocks whose first line is ``# NAME.EXT``."""
    out = set()
    for f in doc_files():
        for b in blocks(f.read_text()):
            m = re.match(r"^#\s*([\w./-]+\.\w+)\s*$", b.lines[0]) if b.lines else None
            if m:
                out.add(m.group(1))
    return out


def recipes(justfile: Path = ROOT / "justfile") -> set[str]:
    """Recipe names of the justfile (``name ARGS:`` at column 0, not ``:=`` assignments)."""
    out = set()
    for line in justfile.read_text().splitlines():
        m = re.match(r"^@?([A-Za-z_][\w-]*)\b[^:=]*:(?!=)", line)
        if m:
            out.add(m.group(1))
    return out
