"""Every command the docs show is one a user can type: checked without running it for minutes.

Static checks over README.md, docs/*.md and examples/*.py (see ``tests/docs_extract.py`` for
what counts as a command): one command style (``.venv/bin/python``, never a bare
``python``), the program exists, every ``key=value`` of a trainer command loads with
``load_config`` (environment assignments in front applied), every ``just`` recipe exists,
every relative link and anchor resolves, every ``TRAINER_*`` name is one the code reads,
every documented ``ConfigError`` is what the command line prints today, and a rehearsal
(``faults=``) sets ``trainer.max_steps``.

Blocks opened as ```` ```bash quick ```` run for real, in order, one temporary directory per
file (``.venv`` there links to this venv; the repository is on ``PYTHONPATH``), so a block
can use what an earlier one made (``ckpt list runs/ck`` after the run that wrote ``runs/ck``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.devices import cuda_unavailable_reason
from tests.docs_extract import (
    ROOT,
    Command,
    anchors,
    blocks,
    commands,
    doc_files,
    env_names,
    example_files,
    links,
    recipes,
    rel,
    shown_files,
    transcripts,
)
from tests.e2e.helpers import fork_server
from trainer import vocabulary
from trainer.__main__ import main
from trainer.config import ConfigWarning, load_config
from trainer.errors import ConfigError

VENV_BIN = Path(sys.executable).parent
#: The stages of a synchronous step, in order: what docs/make_figures.py must draw.
STAGES = tuple(
    s for s in vocabulary.STAGES if s not in ("eval", "wait_for_generation_buffer", "run_training")
)
#: Programs the project does not ship that the docs may name (on the machines they run on).
EXTERNAL = {"curl", "vllm", "nvidia-smi"}
#: The Python of ``bash setup.sh --vllm``'s environment (vLLM's CPU build beside the project).
VLLM_PY = ".venv-vllm/bin/python"
#: vLLM's own command line in that environment (its version lookup answered by the set-up).
VLLM_CLI = ".venv-vllm/bin/vllm"
CKPT_SUBCOMMANDS = {"list", "show", "verify", "prune", "export"}
_OPERATORS = {"&&", "||", ";", "|"}
_REDIRECTS = {"<", ">", ">>", "<<", "2>", "2>&1"}
_ASSIGN = re.compile(r"^[A-Z][A-Z0-9_]*=")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def all_commands() -> list[Command]:
    return [c for f in [*doc_files(), *example_files()] for c in commands(f)]


def simple_commands(cmd: Command) -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, words) of each command of a pipeline or ``&&`` list."""
    lex = shlex.shlex(cmd.text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    out: list[tuple[dict[str, str], list[str]]] = []
    env: dict[str, str] = {}
    words: list[str] = []
    tokens = list(lex)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in _OPERATORS:
            out.append((env, words))
            env, words = {}, []
        elif tok in _REDIRECTS:
            i += 1  # its target
        elif not words and _ASSIGN.match(tok):
            name, _, value = tok.partition("=")
            env[name] = value
        else:
            words.append(tok)
        i += 1
    out.append((env, words))
    return [(e, w) for e, w in out if w]


def trainer_args(words: list[str]) -> list[str] | None:
    """The arguments of a training command (``-m trainer`` or ``just run``), else None."""
    if words[:1] == [VLLM_PY]:  # the same trainer, in vLLM's environment
        words = [".venv/bin/python", *words[1:]]
    if words[:3] == [".venv/bin/python", "-m", "trainer"] and (
        len(words) == 3 or words[3] not in ("ckpt", "debug", "plot")
    ):
        return words[3:]
    if len(words) >= 2 and words[0] in (".venv/bin/just", "just") and words[1] == "run":
        return words[2:]
    return None


def split_config(args: list[str]) -> tuple[str | None, list[str]]:
    """(``--config`` file, the other arguments) of a training command."""
    if "--config" not in args:
        return None, list(args)
    i = args.index("--config")
    return (args[i + 1] if i + 1 < len(args) else None), args[:i] + args[i + 2 :]


def overrides_of(args: list[str]) -> list[str]:
    """The ``key=value`` overrides of training arguments (``--config FILE`` left out)."""
    return [a for a in split_config(args)[1] if "=" in a and not a.startswith("-")]


@functools.cache
def help_text(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, *argv, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def program_problem(words: list[str]) -> str | None:
    """What is wrong with the program a command names (None when it exists)."""
    prog, rest = words[0], words[1:]
    if prog == VLLM_PY:  # made by `bash setup.sh --vllm`: the project's modules, and vLLM's
        if rest[:1] == ["-m"] and len(rest) > 1 and rest[1].split(".")[0] == "vllm":
            return None
        prog = ".venv/bin/python"
    if prog == VLLM_CLI:
        return None if rest[:1] == ["serve"] else f"{VLLM_CLI} {rest[:1]}: the docs serve with it"
    if prog in ("python", "python3", "ray", "pip", "pytest"):
        return f"use .venv/bin/{'python' if prog.startswith('python') else prog}, as README does"
    if prog in EXTERNAL:
        return None
    if prog == "bash":
        return None if rest and (ROOT / rest[0]).is_file() else f"no script {rest[:1]}"
    if prog in ("just", ".venv/bin/just"):
        if not rest or _PLACEHOLDER.match(rest[0]) or rest[0] in recipes():
            return None
        return f"the justfile has no recipe {rest[0]!r} (recipes: {sorted(recipes())})"
    if not prog.startswith(".venv/bin/"):
        return f"unknown program {prog!r} (not shipped, not in EXTERNAL)"
    if not (VENV_BIN / prog.removeprefix(".venv/bin/")).exists():
        return f"{prog} is not installed by setup.sh"
    if prog != ".venv/bin/python" or not rest or rest[0] in ("-", "-c"):
        return None
    if rest[0] != "-m":
        if (ROOT / rest[0]).is_file() or rest[0] in shown_files():
            return None
        return f"no script {rest[0]} (in the repository or shown as a block opening `# {rest[0]}`)"
    module, sub = rest[1], rest[2:]
    if module == "trainer":
        return trainer_problem(sub)
    if module == "engines.local":
        return flags_problem(["-m", "engines.local", *sub[:1]], sub[1:])
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return None if found else f"no module {module!r}"


def trainer_problem(args: list[str]) -> str | None:
    if args and args[0] == "debug":
        if len(args) < 2 or args[1] != "dump":
            return "debug takes one subcommand: dump"
        return flags_problem(["-m", "trainer", "debug", "dump"], args[2:])
    if args and args[0] == "plot":
        return flags_problem(["-m", "trainer", "plot"], args[1:])
    if args and args[0] == "ckpt":
        if len(args) < 2 or args[1] not in CKPT_SUBCOMMANDS:
            return f"ckpt takes one of {sorted(CKPT_SUBCOMMANDS)}"
        return flags_problem(["-m", "trainer", "ckpt", args[1]], args[2:])
    flags = [a for a in args if a.startswith("-")]
    unknown = [f for f in flags if f not in ("--config", "--help", "-h")]
    return f"python -m trainer has no option {unknown[0]}" if unknown else None


def flags_problem(help_argv: list[str], args: list[str]) -> str | None:
    text = help_text(*help_argv)
    for a in args:
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and not re.search(rf"{re.escape(flag)}\b", text):
            return f"`python {' '.join(help_argv)}` has no option {flag}"
    return None


def test_every_command_names_a_program_that_exists_in_one_style():
    problems = [
        f"{c.where}: {c.text}\n    {problem}"
        for c in all_commands()
        for _env, words in simple_commands(c)
        if (problem := program_problem(words))
    ]
    assert not problems, "\n".join(problems)


def training_commands() -> Iterator[tuple[Command, dict[str, str], list[str]]]:
    """(command, environment assignments, training arguments) of every training command."""
    for c in all_commands():
        for env, words in simple_commands(c):
            args = trainer_args(words)
            if args is not None:
                yield c, env, args


def test_every_key_value_is_a_real_config_key_with_a_valid_value():
    problems = []
    for c, env, args in training_commands():
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            for name in [n for n in os.environ if n.startswith("TRAINER_")]:
                mp.delenv(name)
            for name, value in env.items():
                mp.setenv(name, value)
            # with the command's --config file where it is one of the project's (an example);
            # a file the user's run writes (RUN_DIR/config.yaml) is not here to read
            path, _ = split_config(args)
            config = ROOT / path if path and (ROOT / path).is_file() else None
            try:
                load_config(config, overrides_of(args))
            except ConfigError as exc:
                if not _refused_only_for_lack_of_a_gpu(str(exc)):
                    problems.append(f"{c.where}: {c.text}\n    ConfigError: {exc}")
    assert not problems, "\n".join(problems)


def _refused_only_for_lack_of_a_gpu(message: str) -> bool:
    """The run plan refuses at load what this machine cannot give (a CUDA device, vLLM's sleep
    mode, which its CPU build lacks); a GPU command is still checked up to there."""
    reason = cuda_unavailable_reason()
    return reason is not None and (
        reason in message or "vLLM on the CPU has no sleep mode" in message
    )


def test_rehearsals_and_runs_run_by_this_test_set_max_steps():
    problems = []
    for c, env, args in training_commands():
        steps = [a for a in args if a.startswith("trainer.max_steps=")]
        rehearsal = "TRAINER_FAULTS" in env or any(a.startswith("faults=") for a in args)
        if "--help" in args:
            continue
        if (rehearsal or c.quick) and not steps:
            problems.append(f"{c.where}: {c.text}\n    sets no trainer.max_steps")
        elif c.quick and int(steps[-1].split("=")[1]) > 5:
            problems.append(f"{c.where}: a quick run of more than 5 steps")
    assert not problems, "\n".join(problems)


def test_every_relative_link_and_anchor_resolves():
    problems = []
    for f in doc_files():
        for target, where in links(f):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                problems.append(f"{where}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {target}: {rel(dest)} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_every_trainer_environment_variable_named_is_one_the_code_reads():
    source = "\n".join(
        p.read_text() for pkg in ("trainer", "engines", "sync") for p in (ROOT / pkg).rglob("*.py")
    )
    read = set(re.findall(r"[\"'](TRAINER_[A-Z0-9_]+)[\"']", source))
    problems = [
        f"{rel(f)} names {name}, which no code under trainer/, engines/, sync/ reads"
        for f in [*doc_files(), *example_files()]
        for name in sorted(env_names(f) - read)
    ]
    assert not problems, "\n".join(problems)


def _expected(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.strip().split("...")) + "$")


def test_documented_config_errors_are_what_the_command_line_prints(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `--config missing.yaml` stays missing
    for name in [n for n in os.environ if n.startswith("TRAINER_")]:
        monkeypatch.delenv(name)
    checked = 0
    for f in doc_files():
        for t in transcripts(f):
            (_env, words), *_ = simple_commands(t.command)
            args = trainer_args(words)
            errors = [ln for ln in t.output if ln.startswith("ConfigError:")]
            if args is None or not errors:
                continue
            if not any(a.startswith("-") and a != "--config" for a in args):
                config_file, rest = split_config(args)
                with pytest.raises(ConfigError):  # documented as failing: never trains here
                    load_config(config_file, rest)
            assert main(args) == 2, t.command.where
            printed = capsys.readouterr().err.strip().splitlines()[-1]
            assert _expected(errors[0]).match(printed), (
                f"{t.command.where}: documented\n    {errors[0]}\nprinted\n    {printed}"
            )
            checked += 1
    assert checked >= 10


# ---- quick commands, for real ----------------------------------------------------------------


def quick_blocks(path: Path) -> list[tuple[int, str]]:
    return [
        (b.line, "\n".join(b.lines))
        for b in blocks(path.read_text())
        if b.lang in ("bash", "sh", "shell") and "quick" in b.flags
    ]


def _quick_files() -> list[Path]:
    return [f for f in [*doc_files(), *example_files()] if quick_blocks(f)]


def test_the_docs_have_quick_commands():
    assert sum(len(quick_blocks(f)) for f in _quick_files()) >= 3


@pytest.fixture(scope="module")
def quick_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINER_")}
    env["PYTHONPATH"] = str(ROOT)
    if "TRAINER_CACHE_DIR" in os.environ:
        env["TRAINER_CACHE_DIR"] = os.environ["TRAINER_CACHE_DIR"]
    # the runs' reference servers are forked, already imported (docs/engines.md); the
    # commands themselves run as a user types them
    env["TRAINER_FORK_SERVER"] = fork_server()
    return env


@pytest.mark.slow
@pytest.mark.parametrize("f", _quick_files(), ids=rel)
def test_quick_commands_run_for_real_without_failure_or_warning(f, quick_env, tmp_path):
    """Each page's quick blocks in order, in one directory of their own (one test per page)."""
    work = tmp_path / f.stem
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix))
    for line, script in quick_blocks(f):
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            cwd=work,
            env=quick_env,
            timeout=300,
        )
        where = f"{rel(f)}:{line}"
        assert proc.returncode == 0, f"{where} failed:\n{script}\n{proc.stderr[-3000:]}"
        assert not re.search(r"^(warning:|WARNING)", proc.stderr, re.M), (
            f"{where} warned:\n{proc.stderr[-2000:]}"
        )


def test_the_figure_script_draws_both_pictures_from_a_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [
        {
            "step": s,
            "reward/mean": s / 30,
            **{f"timing/{st}": 0.1 * (i + 1) for i, st in enumerate(STAGES)},
        }
        for s in range(1, 31)
    ]
    rows.insert(3, {"step": 3, "eval/reward_mean": 0.5})  # an eval line is skipped
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "docs" / "make_figures.py"),
            str(run_dir),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    timeline = (tmp_path / "step_timeline.svg").read_text()
    assert timeline.startswith("<svg") and timeline.rstrip().endswith("</svg>")
    assert all(stage in timeline for stage in STAGES) and "trainer.step_timeout_s" in timeline
