"""A run's weight-sync bracket is decided once (Bracket.of, held by the run plan): the sync,
the servers' sleep mode and the check of which routes a run calls all read it."""

from __future__ import annotations

import pytest

from sync.bracket import Bracket
from trainer.config import load_config
from trainer.errors import ConfigError

CASES = [
    ([], Bracket.PAUSE),
    (["trainer.strategy=fully_async"], Bracket.PAUSE),
    (["engine.colocated=true"], Bracket.COLOCATED),
    (["engine.colocated=true", "engine.offload_kv_for_weight_sync=true"], Bracket.COLOCATED),
    (["engine.offload_kv_for_weight_sync=true"], Bracket.OFFLOAD_KV),
    (
        ["engine.offload_kv_for_weight_sync=true", "trainer.strategy=fully_async"],
        Bracket.PAUSE_OFFLOAD_KV,
    ),
]


@pytest.mark.parametrize(("overrides", "bracket"), CASES)
def test_the_config_names_one_bracket_and_everything_reads_it(overrides, bracket):
    cfg = load_config(None, overrides)
    assert cfg.plan.bracket is bracket
    # a route fault is accepted exactly when the bracket calls that route
    calls = {
        "/sleep": bracket.sleeps,
        "/wake_up": bracket.sleeps,
        "/pause": bracket.pauses,
        "/resume": bracket.pauses,
        "/reset_prefix_cache": bracket.resets_prefix_cache,
    }
    for route, called in calls.items():
        fault = [f"faults={route}:hang@2"]
        if called:
            load_config(None, [*overrides, *fault])
        else:
            with pytest.raises(ConfigError, match="can never fire"):
                load_config(None, [*overrides, *fault])


def test_each_bracket_is_one_of_the_four_shapes():
    assert [(b.sleeps, b.pauses, b.resets_prefix_cache) for b in Bracket] == [
        (False, True, True),  # pause -> transfer -> reset -> resume
        (True, False, False),  # wake weights -> transfer -> wake kv
        (True, False, False),  # sleep -> wake weights -> transfer -> wake kv
        (True, True, False),  # pause -> sleep -> wake weights -> transfer -> wake kv -> resume
    ]
