"""``python -m trainer ckpt {list,show,verify,prune,export} DIR``: inspect a run's checkpoints.

``DIR`` is a run directory (holding ``checkpoints/``) or a ``checkpoints`` directory;
``show``, ``verify`` and ``export`` also accept one ``global_step_N`` directory (else the
latest). ``export DIR OUT`` writes the policy as a servable model directory
(:mod:`trainer.checkpoint._export`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainer.checkpoint._export import export_policy
from trainer.checkpoint._inspect import list_checkpoints
from trainer.checkpoint._layout import TRAINER_STATE_FILE, read_trainer_state, step_dirs, verify
from trainer.checkpoint._manager import CheckpointManager
from trainer.errors import CheckpointError

__all__ = ["ckpt_main"]


def _root(path: Path) -> Path:
    """The ``checkpoints`` directory: ``path`` itself, or ``path/checkpoints`` in a run dir."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def _one(path: Path) -> Path:
    """A single checkpoint: the directory itself, or the latest under a run/checkpoints dir."""
    if (path / TRAINER_STATE_FILE).is_file():
        return path
    latest = CheckpointManager(_root(path), None).latest()
    if latest is None:
        raise SystemExit(f"ckpt: no checkpoint under {path}")
    return latest


def _export(args: argparse.Namespace) -> int:
    if args.out is None:
        print("ckpt export: OUT (the new model directory) is required", file=sys.stderr)
        return 2
    path = _one(args.dir)
    try:
        what = export_policy(path, args.out, adapter=args.adapter, base=args.base)
    except CheckpointError as exc:
        print(f"ckpt export: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {what}, from {path}")
    return 0


def ckpt_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer ckpt", description=__doc__)
    parser.add_argument("action", choices=["list", "show", "verify", "prune", "export"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("out", type=Path, nargs="?", help="export: the new model directory")
    parser.add_argument("--keep", type=int, default=None, help="prune: how many newest to keep")
    parser.add_argument(
        "--adapter", action="store_true", help="export: a LoRA run's adapter (peft), not merged"
    )
    parser.add_argument(
        "--base", type=Path, default=None, help="export: the LoRA adapter's base model directory"
    )
    args = parser.parse_args(argv)
    if not args.dir.exists():
        print(f"ckpt: {args.dir} does not exist", file=sys.stderr)
        return 2
    if args.action == "export":
        return _export(args)
    if args.action == "list":
        infos = list_checkpoints(_root(args.dir))
        if not infos:
            print(f"no checkpoints under {args.dir}")
        for info in infos:
            mark = " (latest)" if info.is_latest else ""
            print(f"global_step_{info.step}\t{info.size / 1e6:.1f} MB\t{info.path}{mark}")
        return 0
    if args.action == "show":
        path = _one(args.dir)
        print(f"{path}")
        print(json.dumps(read_trainer_state(path), indent=2))
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            print(f"  {f.relative_to(path)}\t{f.stat().st_size} bytes")
        return 0
    if args.action == "verify":
        paths = (
            [_one(args.dir)]
            if (args.dir / TRAINER_STATE_FILE).is_file()
            else [i.path for i in list_checkpoints(_root(args.dir))]
        )
        bad = 0
        for path in paths:
            problems = verify(path)
            print(f"{path}: {'OK' if not problems else 'BROKEN'}")
            for p in problems:
                print(f"  - {p}")
            bad += bool(problems)
        return 1 if bad else 0
    if args.keep is None or args.keep < 1:
        print("ckpt prune: --keep N (N >= 1) is required", file=sys.stderr)
        return 2
    root = _root(args.dir)
    links = {path: os.readlink(path) for _, path in step_dirs(root) if path.is_symlink()}
    for removed in CheckpointManager(root, None).prune(args.keep):
        if removed in links:  # the link alone: what it points at is not the run's to delete
            print(f"removed the link {removed} (its target {links[removed]} is left as it is)")
        else:
            print(f"removed {removed}")
    return 0
