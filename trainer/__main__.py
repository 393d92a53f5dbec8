"""``python -m trainer [--config FILE.yaml] [key=value ...]`` and its subcommands.

Subcommands: ``ckpt {list,show,verify,prune,export} DIR``, ``debug dump PID|RUN_DIR``,
``plot RUN_DIR [RUN_DIR...]`` (needs the ``plot`` extra: matplotlib), ``serve [key=value ...]``
(the Tinker-protocol training service: docs/tinker.md). On failure the last line on stderr is
``ErrorClass: message`` and the exit status is non-zero (2 for bad configuration); the
traceback goes to the run's ``train.log`` (and to stderr too with ``--verbose``).
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from pathlib import Path

__all__ = ["main"]

#: Subcommands with their own ``--help``.
SUBCOMMANDS = ("ckpt", "debug", "plot", "serve")

USAGE = """\
usage: python -m trainer [--config FILE.yaml] [--verbose] [key=value ...]
       python -m trainer ckpt {list,show,verify,prune} DIR [--keep N]
       python -m trainer ckpt export DIR OUT [--adapter] [--base MODEL_DIR]
       python -m trainer debug dump PID|RUN_DIR [--json]
       python -m trainer plot RUN_DIR [RUN_DIR...] [--out DIR]
       python -m trainer serve [--config FILE.yaml] [key=value ...]

Train with the configuration's defaults overridden by FILE.yaml, then by key=value pairs
(e.g. trainer.max_steps=100 generator.n_samples_per_prompt=8). A failed run ends its stderr
with one line, `ErrorClass: message`; its traceback is in RUN_DIR/train.log (--verbose also
prints it on stderr).
"""


def _print_help() -> None:
    from trainer.config import help_text

    print(USAGE)
    print("Configuration keys (key = default  (type)):")
    print(help_text())


def _fail(
    exc: BaseException, *, code: int, show_traceback: bool, log_file: Path | None = None
) -> int:
    """Print ``exc`` as its last line on stderr: ``ErrorClass: message``; return ``code``.
    A ConfigError with several problems prints one line each, then ``ConfigError: config: N
    problems (above)``.

    With ``show_traceback`` the traceback comes first. Otherwise, when ``log_file`` holds it
    (the run's ``train.log``), the notes and a line saying where the traceback is come first;
    an error with no log to hold its traceback (one raised before the run's log existed)
    prints the traceback here, so nothing is lost.
    """
    logged = log_file is not None and log_file.exists()
    if show_traceback or (log_file is not None and not logged):
        traceback.print_exception(exc, file=sys.stderr)
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # a nursery's wrapper around the one real error
    if logged and not show_traceback:
        for note in getattr(exc, "__notes__", ()):
            print(f"note: {note}", file=sys.stderr)
        print(f"the traceback is in {log_file} (--verbose prints it here)", file=sys.stderr)
    from trainer.errors import ConfigError

    headline, *details = str(exc).split("\n")
    if details and isinstance(exc, ConfigError):  # several problems: one line each, above
        for line in details:
            print(f"  {line}", file=sys.stderr)
        print(f"{type(exc).__name__}: {headline} (above)", file=sys.stderr, flush=True)
        return code
    message = " | ".join((headline, *details))
    print(f"{type(exc).__name__}: {message}", file=sys.stderr, flush=True)
    return code


def _train(argv: list[str]) -> int:
    import trio

    from trainer.config import ConfigWarning, load_config
    from trainer.errors import CheckpointError, ConfigError, DataError

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--verbose", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    unknown_flags = [o for o in overrides if o.startswith("-")]
    if unknown_flags:
        print(USAGE, file=sys.stderr)
        return _fail(
            ConfigError(f"unknown option {unknown_flags[0]!r}"), code=2, show_traceback=False
        )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            cfg = load_config(args.config, overrides)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except (ConfigError, DataError) as exc:
        return _fail(exc, code=2, show_traceback=False)

    from trainer.run import train, with_run_dir

    cfg = with_run_dir(cfg)  # chosen here, so a failure can say where its log is
    log_file = Path(cfg.trainer.run_dir or ".") / "train.log"
    try:
        summary = trio.run(train, cfg)
    except KeyboardInterrupt as exc:  # the run says where it was and that it stopped cleanly
        print(f"KeyboardInterrupt: {exc or 'training interrupted'}", file=sys.stderr)
        return 130
    except (ConfigError, DataError, CheckpointError) as exc:
        return _fail(exc, code=2, show_traceback=args.verbose)
    except BaseException as exc:
        return _fail(exc, code=1, show_traceback=args.verbose, log_file=log_file)
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    console.print(
        f"[bold]done[/bold]: {int(summary.get('steps', 0))} steps in {summary['run_dir']}"
    )
    if "reward/first_20pct" in summary:
        console.print(
            f"mean reward: first 20% of steps {summary['reward/first_20pct']:.3f} -> "
            f"last 20% {summary['reward/last_20pct']:.3f}; "
            f"mean step time {summary['step_time_mean_s'] or 0.0:.2f}s"
        )
    if "eval/last_step" in summary:
        first, last = _eval_at(summary, "first"), _eval_at(summary, "last")
        line = f"eval: {first}" + ("" if first == last else f" -> {last}")
        console.print(line, soft_wrap=True)
    counted = [f"{v:g} {k}" for k, v in summary.get("totals", {}).items() if v]
    restarts = summary.get("engine_restarts")
    if restarts:
        counted.insert(0, f"{restarts} engine restart{'s' if restarts > 1 else ''}")
    if counted:  # what went wrong and was absorbed, and what steps spent (summary.json)
        console.print("counted over the run: " + ", ".join(counted), soft_wrap=True)
    if summary.get("totals", {}).get("mismatch/crossed"):  # train.log has each warning
        worst = [
            f"{k} {v['worst']:.4g} at step {int(v['worst_step'])}"
            for k, v in summary.get("mismatch", {}).items()
        ]
        console.print(
            "the engine and the trainer disagreed past algorithm.mismatch's thresholds; "
            "worst: " + ", ".join(worst),
            soft_wrap=True,
        )
    for event in summary.get("engine_restart_events", []):
        if event.get("seconds") is None:  # the run ended before the engine served again
            console.print(
                f"engine {event['engine']}: its restart (it failed at step {event['step']}) "
                "was still running when the run ended and was abandoned",
                soft_wrap=True,
            )


def _eval_at(summary: dict, which: str) -> str:
    from trainer.metrics import EVAL_SUMMARY_KEYS, eval_line

    keys = [k for k in EVAL_SUMMARY_KEYS if f"eval/{which}_{k}" in summary]
    metrics = {f"eval/{k}": summary[f"eval/{which}_{k}"] for k in keys}
    return f"{eval_line(metrics, compact=True)} at step {int(summary[f'eval/{which}_step'])}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if any(a in ("-h", "--help") for a in argv) and command not in SUBCOMMANDS:
        _print_help()
        return 0
    if command == "ckpt":
        from trainer.checkpoint import ckpt_main

        return ckpt_main(argv[1:])
    if command == "debug":
        from trainer.debug import debug_main

        return debug_main(argv[1:])
    if command == "plot":
        try:
            from trainer.metrics.plots import plot_main
        except ImportError as exc:  # matplotlib is an optional extra
            print(f"plot needs matplotlib ({exc}): pip install 'trainer[plot]'", file=sys.stderr)
            return 2
        return plot_main(argv[1:])
    if command == "serve":
        from trainer.serve import serve_main

        return serve_main(argv[1:])
    return _train(argv)


if __name__ == "__main__":
    sys.exit(main())
