"""README's "What works today" table stays true: it is checked against the config schema.

Every allowed value of a mode key (a ``Literal`` key named ``backend``, ``strategy``,
``placement``, ``transport`` or ``device``) must appear in the table as ``key=value``, so a
new engine, worker backend or strategy fails here until the table describes it; and each row's
status follows from the schema (``vLLM`` is built only once ``engine.backend`` allows
``vllm``, and so on). A row is "yes" (built and run on its hardware), "partly verified" (built,
and some of it run on its hardware: the row names which), "unverified" (built, but never run
where it is meant to run: the GPU paths on a CPU-only machine) or "not yet".
"""

from __future__ import annotations

import re
import typing
from typing import Literal

from tests.docs_extract import ROOT
from trainer.config._load import iter_fields

README = ROOT / "README.md"
MODE_NAMES = {"backend", "strategy", "placement", "transport", "device"}
ROWS = {
    "CPU",
    "GPU",
    "vLLM",
    "Ray",
    "fully-async",
    "engine fault tolerance",
    "LoRA",
    "Tinker service",
}
STATUSES = ("yes", "partly verified", "unverified", "not yet")


def mode_values() -> dict[str, tuple[str, ...]]:
    """Allowed values of every mode key of the schema."""
    return {
        key: typing.get_args(tp)
        for key, _a, tp in iter_fields()
        if key.rsplit(".", 1)[-1] in MODE_NAMES and typing.get_origin(tp) is Literal
    }


def table() -> dict[str, tuple[str, str]]:
    """Row name -> (status, what there is) of README's table."""
    text = README.read_text()
    assert "## What works today" in text, "README.md lost its 'What works today' section"
    section = text.split("## What works today", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(
            r"^\|\s*\*\*(?P<name>[^*]+)\*\*\s*\|\s*(?P<status>[^|]+?)\s*\|(?P<what>.*)\|$", line
        )
        if m:
            rows[m["name"]] = (m["status"], m["what"])
    return rows


def gpu_training_built() -> bool:
    """A device key in the schema, or a worker that moves its model to CUDA."""
    worker = (ROOT / "trainer" / "workers" / "policy.py").read_text()
    has_key = any(key.rsplit(".", 1)[-1] == "device" for key, _a, _tp in iter_fields())
    return has_key or bool(re.search(r"cuda|\.to\(\s*device", worker))


def test_the_table_has_one_row_per_feature_with_a_known_status():
    rows = table()
    assert set(rows) == ROWS
    assert all(status in STATUSES for status, _ in rows.values()), rows


def test_every_allowed_mode_value_is_described_in_the_table():
    described = " ".join(what for _, what in table().values())
    missing = [
        f"{key}={value}"
        for key, values in mode_values().items()
        for value in values
        if f"`{key}={value}`" not in described
    ]
    assert not missing, (
        f"README's 'What works today' table does not describe {missing}: the schema allows "
        "them now; say what they do (and update the row's status)"
    )


def test_each_status_follows_from_the_schema():
    modes = mode_values()
    expected = {
        "CPU": True,
        "GPU": gpu_training_built(),
        "vLLM": "vllm" in modes["engine.backend"],
        "Ray": "ray" in modes["workers.backend"],
        "fully-async": "fully_async" in modes["trainer.strategy"],
        "engine fault tolerance": any(
            key == "engine.max_restarts" for key, _a, _t in iter_fields()
        ),
        "LoRA": any(key == "model.lora.rank" for key, _a, _t in iter_fields()),
        "Tinker service": any(key.startswith("serve.") for key, _a, _t in iter_fields()),
    }
    wrong = {
        name: status
        for name, (status, _) in table().items()
        if (status != "not yet") != expected[name]
    }
    assert not wrong, f"README's 'What works today' is out of date: {wrong}; today {expected}"
