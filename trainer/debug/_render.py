"""A snapshot (see :mod:`trainer.debug._snapshot`) as a tree for people, and where a run is.

``render(snapshot)`` is the rich tree that ``python -m trainer debug dump`` prints and the
watchdog writes to ``train.log``; ``where_line(snapshot)`` is the one line a Ctrl-C prints:
``step 2 (stage='train_critic_and_policy', operation='forward_backward')``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from trainer.debug._snapshot import Snapshot, TaskNode

__all__ = ["innermost_place", "render", "stalest_line", "tree_of", "where_line"]

#: Siblings alike in all but name are shown once with a count past this many.
_COLLAPSE_AT = 4


def _walk(node: TaskNode, depth: int = 0) -> Iterator[tuple[int, TaskNode]]:
    yield depth, node
    for child in node["children"]:
        yield from _walk(child, depth + 1)


def innermost_place(snapshot: Snapshot) -> TaskNode | None:
    """The deepest task with an operation open (else with a stage, else a step), or None.

    That is where the run is waiting: the loop's task names the stage, the task it waits on
    (a worker call, one server's ``/pause``) names the operation.
    """
    best: tuple[int, int, TaskNode] | None = None
    for depth, node in _walk(snapshot["tasks"]):
        rank = 3 if node["operation"] else 2 if node["stage"] else 1 if node["step"] else 0
        if rank and (best is None or (rank, depth) > best[:2]):
            best = (rank, depth, node)
    return None if best is None else best[2]


def where_line(snapshot: Snapshot) -> str:
    """``step N (stage='...', operation='...')``, or ``startup`` before the first step."""
    node = innermost_place(snapshot)
    if node is None or (node["step"] is None and node["stage"] is None):
        return "startup (no step running)"
    step = node["step"] if node["step"] is not None else "?"
    return f"step {step} (stage={node['stage']!r}, operation={node['operation'] or 'await'!r})"


def stalest_line(snapshot: Snapshot) -> str:
    """The open operation of the running step that has gone longest without running, and how
    long: ``operation 'generate' (stage 'generate') has not run for 58.0s``. Tasks with an
    operation first (a stage's task waits on its operations' tasks, so it always looks
    stalest), else with a stage; :func:`where_line` where no task has a wait clock."""
    running = snapshot["step"]
    step = running["step"] if running else None
    found: tuple[int, float, TaskNode] | None = None
    for _depth, node in _walk(snapshot["tasks"]):
        rank = 2 if node["operation"] else 1 if node["stage"] else 0
        waited = node["waiting_s"]
        if not rank or waited is None or (step is not None and node["step"] not in (step, None)):
            continue
        if found is None or (rank, waited) > found[:2]:
            found = (rank, waited, node)
    if found is None:
        return where_line(snapshot)
    _rank, waited, node = found
    what = f"operation {node['operation']!r}" if node["operation"] else "its task"
    return f"{what} (stage {node['stage']!r}) has not run for {waited:.1f}s"


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}s"


def _task_label(node: TaskNode, count: int = 1) -> str:
    parts = [
        f"[bold]{escape(node['name'])}[/bold]" + (f" [dim]x{count}[/dim]" if count > 1 else "")
    ]
    if node["step"] is not None:
        parts.append(f"step {node['step']}")
    if node["stage"]:
        parts.append(f"stage=[cyan]{escape(node['stage'])}[/cyan]")
    if node["operation"]:
        parts.append(f"operation=[magenta]{escape(node['operation'])}[/magenta]")
    if node["budget_s"] is not None:
        parts.append(
            f"{node['deadline_error']} in {_seconds(node['remaining_s'])} "
            f"(budget {node['budget_s']:g}s)"
        )
    if node["waiting_s"] is not None:
        parts.append(f"waiting {_seconds(node['waiting_s'])}")
    if node["at"]:
        parts.append(f"[dim]at {escape(node['at'])}[/dim]")
    return "  ".join(parts)


def _signature(node: TaskNode) -> tuple[object, ...]:
    return (node["stage"], node["operation"], node["step"], node["at"], bool(node["children"]))


def _add_tasks(tree: Tree, node: TaskNode, count: int = 1) -> None:
    branch = tree.add(_task_label(node, count))
    groups: dict[tuple[object, ...], list[TaskNode]] = {}
    for child in node["children"]:
        groups.setdefault(_signature(child), []).append(child)
    for members in groups.values():
        if len(members) > _COLLAPSE_AT and not members[0]["children"]:
            _add_tasks(branch, members[0], len(members))
        else:
            for child in members:
                _add_tasks(branch, child)


def _engine_label(engine: dict[str, object]) -> str:
    url = escape(str(engine["url"]))
    if "error" in engine:
        return f"{url}  [red]{escape(str(engine['error']))}[/red]"
    fields = "  ".join(f"{k}={v}" for k, v in engine.items() if k != "url")
    return f"{url}  {escape(fields)}"


def tree_of(snapshot: Snapshot) -> Tree:
    """The snapshot as a rich ``Tree``: tasks, busy threads with stacks, engine servers."""
    step = snapshot.get("step")
    running = (
        f"step {step['step']} running for {step['running_s']:.1f}s" if step else "no step running"
    )
    root = Tree(
        f"[bold]trainer pid {snapshot['pid']}[/bold]  {escape(snapshot['run_dir'])}  "
        f"{running}  at {snapshot['taken_at']}  -- {escape(where_line(snapshot))}"
    )
    _add_tasks(root.add("[bold]trio tasks[/bold]"), snapshot["tasks"])
    threads = root.add(
        f"[bold]threads[/bold] ({len(snapshot['threads'])} busy, "
        f"{snapshot['idle_threads']} idle trio workers)"
    )
    for thread in snapshot["threads"]:
        branch = threads.add(
            f"[bold]{escape(thread['name'])}[/bold]" + (" (daemon)" if thread["daemon"] else "")
        )
        for line in thread["stack"]:
            branch.add(escape(line))
    if snapshot["engines"]:
        engines = root.add("[bold]engine servers[/bold]")
        for engine in snapshot["engines"]:
            engines.add(_engine_label(engine))
    return root


def render(snapshot: Snapshot, *, width: int = 1000) -> str:
    """The tree of :func:`tree_of` as plain text (no colour), for logs and pipes; lines are
    cut at ``width`` characters."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, soft_wrap=True).print(tree_of(snapshot))
    return buffer.getvalue()
