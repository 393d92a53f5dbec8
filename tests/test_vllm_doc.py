"""``docs/vllm.md``'s "What is verified where" table stays true.

Every file a row names exists; every status is one of the table's kinds; no row may claim
the GPU check before ``docs/performance.md`` records a ``gpu_check.py --vllm`` run.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "vllm.md").read_text()
STATUSES = ("CPU conformance", "CPU,", "CPU (", "GPU check", "not yet verified")


def rows() -> list[list[str]]:
    section = DOC.split("## What is verified where", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| what | status | checked by |"), lines[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_table_has_rows_for_each_path() -> None:
    table = rows()
    assert len(table) >= 6
    text = " ".join(what for what, _, _ in table)
    for subject in ("vllm serve", "vllm_inprocess", "nccl", "ipc"):
        assert subject in text, subject


def test_every_file_the_table_names_exists() -> None:
    for what, _, checked_by in rows():
        for path in re.findall(r"`((?:tests|benchmarks)/[^`]+)`", checked_by):
            assert (ROOT / path).exists(), f"{what[:40]}...: {path} does not exist"


def test_every_status_is_one_the_table_knows_and_gpu_claims_have_a_record() -> None:
    performance = (ROOT / "docs" / "performance.md").read_text()
    for what, status, _ in rows():
        assert status.startswith(STATUSES), f"{what[:40]}...: unknown status {status!r}"
        if "GPU check" in status:
            assert "gpu_check.py --vllm" in performance, (
                f"{what[:40]}... claims the GPU check, and docs/performance.md has no "
                "`gpu_check.py --vllm` run"
            )
