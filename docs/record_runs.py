"""Run the commands whose output the docs quote, record what they printed, write it into the docs.

    .venv/bin/python docs/record_runs.py            # both runs, then the docs
    .venv/bin/python docs/record_runs.py --figures  # also redraw the README's two figures
    .venv/bin/python docs/record_runs.py --docs     # only rewrite the docs from the record

Run it on an idle machine. It runs the README's default run (``.venv/bin/python -m trainer
trainer.run_dir=runs/default``) and the quickstart's first run exactly as documented, from the
repository root, keeps what they printed in ``docs/measured_runs.json`` (with the date and the
machine's load), and rewrites the blocks of README.md and docs/quickstart.md that quote them
(between ``<!-- BEGIN MEASURED: NAME -->`` and ``<!-- END MEASURED -->``). No number in those
blocks is typed by hand: ``tests/test_doc_numbers.py`` checks that the blocks are what this
script renders from the record, and that the quickstart's run still prints the recorded
rewards and losses.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "measured_runs.json"
PY = ".venv/bin/python"
VLLM_PY = ".venv-vllm/bin/python"
#: The documented commands, as the docs spell them (``.venv/bin/python`` is this interpreter).
COMMANDS = {
    "default": f"{PY} -m trainer trainer.run_dir=runs/default",
    "first": f"{PY} -m trainer trainer.max_steps=2 trainer.run_dir=runs/first",
    "vllm": f"{VLLM_PY} -m trainer engine.backend=vllm sync.transport=gloo trainer.run_dir=runs/vllm",
}
#: Where each record is quoted.
DOCS = {
    "default": ROOT / "README.md",
    "first": ROOT / "docs" / "quickstart.md",
    "vllm": ROOT / "docs" / "vllm.md",
}
BLOCK = re.compile(r"(<!-- BEGIN MEASURED: (\w+) -->\n)(.*?)(<!-- END MEASURED -->)", re.S)
STARTUP = re.compile(r"^startup: .* ready in (\d+\.\d)s$")


def run(name: str) -> dict:
    """Run one documented command; what it printed on stderr, its wall time and step times."""
    python, *args = COMMANDS[name].split()
    argv = [sys.executable if python == PY else str(ROOT / python), *args]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.monotonic() - started
    run_dir = ROOT / COMMANDS[name].split("trainer.run_dir=")[1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = proc.stderr.splitlines()
    return {
        "command": COMMANDS[name],
        "wall_s": round(wall, 1),
        "startup_s": round(sum(float(m[1]) for m in map(STARTUP.match, lines) if m), 1),
        "step_s_median": round(statistics.median(r["timing/step"] for r in rows), 3),
        "stderr": lines,
    }


def render(name: str, rec: dict, record: dict) -> str:
    """The docs block that quotes run ``name`` of ``record``."""
    if name == "first":
        return "```\n" + "\n".join(rec["stderr"]) + "\n```\n"
    summary = rec["stderr"][-1]
    first, last = (float(x) for x in re.findall(r"\d+\.\d+", summary)[:2])
    if name == "vllm":
        return (
            f"Measured {rec['measured']} ({rec['machine']}): **{rec['wall_s']:.0f} s** wall for\n"
            f"the whole command, {rec['startup_s']:.0f} s of it startup (most of it vLLM's);\n"
            f"then each step takes {rec['step_s_median']:.2f} s (median). The end of the output:\n"
            "\n```\n" + "\n".join(rec["stderr"][-2:]) + "\n```\n\n"
            f"The mean reward climbs from {first:.2f} to {last:.2f}, as with the reference engine.\n"
        )
    return (
        f"Measured {record['measured']} ({record['machine']}): **{rec['wall_s']:.0f} s** wall\n"
        f"for the whole command, {rec['startup_s']:.0f} s of it startup (building the model,\n"
        f"starting the engine server); then each step takes {rec['step_s_median']:.2f} s\n"
        "(median); the busier the machine, the longer. The end of the output:\n"
        "\n```\n" + "\n".join(rec["stderr"][-2:]) + "\n```\n\n"
        f"The mean reward climbs from {first:.2f} (about that of a random policy; see\n"
        f"[docs/concepts.md](docs/concepts.md#built-in-tasks)) to {last:.2f}.\n"
    )


def rendered_docs(record: dict) -> dict[Path, str]:
    """Each quoting doc's text with its blocks rendered from ``record``."""
    out = {}
    for path in DOCS.values():
        text = path.read_text()

        def block(m: re.Match[str], path: Path = path) -> str:
            if m[2] not in record["runs"]:
                raise SystemExit(f"{path.name}: no recorded run named {m[2]!r}")
            return m[1] + render(m[2], record["runs"][m[2]], record) + m[4]

        out[path] = BLOCK.sub(block, text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true", help="only rewrite the docs")
    parser.add_argument("--figures", action="store_true", help="also redraw the figures")
    args = parser.parse_args()
    if not args.docs:
        load = os.getloadavg()[0]
        names = [n for n in COMMANDS if n != "vllm" or (ROOT / VLLM_PY).exists()]
        if "vllm" not in names:
            print(f"no {VLLM_PY} (bash setup.sh --vllm): keeping the recorded vllm run")
        old = json.loads(RECORD.read_text())["runs"] if RECORD.exists() else {}
        record = {
            "measured": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} cores, load average {load:.2f} before the runs",
            "runs": {**old, **{name: run(name) for name in names}},
        }
        for name in names:  # each run says when it was measured (a kept one keeps its own)
            record["runs"][name] |= {"measured": record["measured"], "machine": record["machine"]}
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
    record = json.loads(RECORD.read_text())
    for path, text in rendered_docs(record).items():
        path.write_text(text)
    if args.figures:  # the README shows reward.png of plot's pictures, and the timeline
        plots = ROOT / "runs" / "default" / "plots"
        subprocess.run(
            [sys.executable, "-m", "trainer", "plot", "runs/default", "--out", str(plots)],
            cwd=ROOT,
            check=True,
        )
        (ROOT / "docs" / "images" / "reward.png").write_bytes((plots / "reward.png").read_bytes())
        subprocess.run(
            [sys.executable, "docs/make_figures.py", "runs/default"], cwd=ROOT, check=True
        )


if __name__ == "__main__":
    main()
