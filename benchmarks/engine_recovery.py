"""Engine servers killed from outside (``kill -9``) at random moments of a long run.

::

    python benchmarks/engine_recovery.py [--steps 200] [--kills 3] [--engines 2] [--seed 0]
    .venv-vllm/bin/python benchmarks/engine_recovery.py --backend vllm --steps 40 --kills 1

Runs ``python -m trainer`` twice with the same seed, in this Python: a clean run, then one
during which an engine server (a random one of ``--engines``, its whole process group) gets
``SIGKILL`` ``--kills`` times, each at a random step once the previous one is back. Prints,
for each kill, the seconds from the kill to the failure being noticed and to the engine being
back in rotation (restarted, synced, verified: it serves the next request); then whether the
run completed, ``engine/restarts``, whether both runs trained on the same prompts in the same
order (none lost, none twice), the mean reward of each run per fifth of its steps, and any
process left behind. Issue 31's acceptance: 3 kills in 200 steps of the default run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.helpers import processes_with_marker  # noqa: E402

SERVER_MARKS = ("engines.local", "engines.launch.stdin_guard")
LOG_TIME = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING trainer\.run: engine (\d+) (.*)$"
)


def _env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_FAULTS"}
    env["TRAINER_TEST_MARKER"] = marker
    env["PYTHONPATH"] = str(REPO)
    return env


def _command(run_dir: Path, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "trainer", "trainer.progress=false", f"trainer.run_dir={run_dir}"]
    cmd += [f"engine.backend={args.backend}", f"engine.num_engines={args.engines}"]
    cmd += [f"trainer.max_steps={args.steps}", f"trainer.seed={args.seed}", *args.overrides]
    return cmd


def _servers(trainer_pid: int) -> list[int]:
    """The trainer's engine servers (its children that lead their own process group)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid, pgid = int(stat[1]), int(stat[2])
        if (
            ppid == trainer_pid
            and pgid == int(proc.name)
            and any(m in cmdline for m in SERVER_MARKS)
        ):
            found.append(int(proc.name))
    return sorted(found)


def _steps_done(run_dir: Path) -> int:
    try:
        return sum(1 for _ in (run_dir / "metrics.jsonl").open())
    except OSError:
        return 0


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _log_events(run_dir: Path) -> list[tuple[float, int, str]]:
    """(epoch seconds, engine, text) of the run's engine warnings."""
    out = []
    for line in (run_dir / "train.log").read_text().splitlines():
        m = LOG_TIME.match(line)
        if m:
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, int(m.group(2)), m.group(3)))
    return out


def killed_run(run_dir: Path, args: argparse.Namespace, rng: random.Random) -> dict:
    marker = uuid.uuid4().hex
    log = open(run_dir.parent / "killed.out", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        _command(run_dir, args), stdout=log, stderr=subprocess.STDOUT, env=_env(marker), cwd=REPO
    )
    margin = max(2, args.steps // 20)
    kills: list[dict] = []
    try:
        while len(kills) < args.kills and proc.poll() is None:
            done = _steps_done(run_dir)
            left = args.kills - len(kills)
            last = args.steps - margin * left
            if done < margin or last <= done:
                time.sleep(0.05)
                continue
            target = rng.randint(done + 1, max(done + 1, done + (last - done) // left))
            while _steps_done(run_dir) < target and proc.poll() is None:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.3))  # somewhere inside the step
            servers = _servers(proc.pid)
            if len(servers) < args.engines:  # one is still coming back: wait for it
                time.sleep(0.2)
                continue
            index = rng.randrange(len(servers))
            os.killpg(servers[index], signal.SIGKILL)
            kills.append(
                {"at": time.time(), "pid": servers[index], "step": _steps_done(run_dir) + 1}
            )
            # wait for it to be back before the next kill
            while proc.poll() is None and len(_servers(proc.pid)) < args.engines:
                time.sleep(0.1)
            while proc.poll() is None and sum(
                "back at" in t for _, _, t in _log_events(run_dir)
            ) < len(kills):
                time.sleep(0.1)
        proc.wait(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    time.sleep(2)
    return {"returncode": proc.returncode, "kills": kills, "left": processes_with_marker(marker)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="local", choices=["local", "vllm"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--keep", type=Path, default=None, help="keep both runs' directories here")
    parser.add_argument("overrides", nargs="*", help="more trainer overrides (key=value)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        clean = subprocess.run(
            _command(root / "clean", args),
            capture_output=True,
            text=True,
            env=_env(uuid.uuid4().hex),
            cwd=REPO,
            timeout=args.timeout,
        )
        clean_s = time.monotonic() - t0
        if clean.returncode != 0:
            sys.exit(f"the clean run failed:\n{clean.stderr[-3000:]}")
        t0 = time.monotonic()
        result = killed_run(root / "killed", args, rng)
        killed_s = time.monotonic() - t0
        print(f"{args.backend}: {args.engines} engines, {args.steps} steps, seed {args.seed}")
        print(
            f"clean run {clean_s:.1f}s, killed run {killed_s:.1f}s, exit code {result['returncode']}"
        )
        if result["returncode"] != 0:
            out = (root / "killed.out").read_text().splitlines()
            print("\n".join(line[:2000] for line in out if not line.startswith(" "))[-4000:])
        events = _log_events(root / "killed")
        failed = [(w, t) for w, _, t in events if t.startswith("(") or " failed: " in t]
        back = [w for w, _, t in events if "back at" in t]
        print(f"{'kill':<6}{'step':>6}{'noticed after s':>17}{'back after s':>14}  cause")
        for i, kill in enumerate(result["kills"]):
            noticed = next(((w, t) for w, t in failed if w >= kill["at"] - 0.01), (None, ""))
            returned = next((w for w in back if w >= kill["at"]), None)
            seen = f"{noticed[0] - kill['at']:.2f}" if noticed[0] else "-"
            came = f"{returned - kill['at']:.2f}" if returned else "-"
            cause = noticed[1].split(": ", 1)[-1][:70]
            print(f"{i + 1:<6}{kill['step']:>6}{seen:>17}{came:>14}  {cause}")
        rows, clean_rows = _rows(root / "killed"), _rows(root / "clean")
        print(f"steps logged: {len(rows)}; engine/restarts: {rows[-1].get('engine/restarts')}")
        same = [r["data/example_index"] for r in rows] == [
            r["data/example_index"] for r in clean_rows
        ]
        print(f"same prompts in the same order as the clean run: {same}")
        fifth = max(1, args.steps // 5)
        for name, rs in (("clean", clean_rows), ("killed", rows)):
            means = [
                statistics.fmean(r["reward/mean"] for r in rs[i : i + fifth])
                for i in range(0, len(rs), fifth)
            ]
            print(f"reward/mean per fifth, {name:>6}: " + " ".join(f"{m:.3f}" for m in means))
        print(f"processes left: {result['left'] or 'none'}")


if __name__ == "__main__":
    main()
