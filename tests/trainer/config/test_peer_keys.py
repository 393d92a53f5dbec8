"""A verl or SkyRL user's keys are answered with this trainer's key and value, every bad key of
one command line is reported at once, and ``SECTION.enable`` names the key that turns the
section on (issue 64: each of these got "unknown key ...; see --help", one key per attempt)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from trainer.__main__ import main
from trainer.config import load_config
from trainer.config._load import _coerce, iter_fields
from trainer.config._peer_keys import PEER_KEYS, peer_key_table
from trainer.errors import ConfigError

KNOWN = {key: tp for key, _a, tp in iter_fields()}
ROOT = Path(__file__).resolve().parents[3]


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    ("override", "answer"),
    [
        (
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "'actor_rollout_ref.actor.clip_ratio_high' is verl's key: "
            "write algorithm.clip_ratio_high=0.28",
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "write algorithm.loss_agg_mode=seq-mean-token-sum-norm",
        ),
        ("algorithm.filter_groups.enable=true", "write algorithm.dynamic_sampling.type=filter"),
        ("algorithm.filter_groups.enable=false", "write algorithm.dynamic_sampling.type=none"),
        (
            "reward_model.overlong_buffer.enable=true",
            "write algorithm.overlong_buffer.len=N (the buffer's length in tokens; 0 is off)",
        ),
        (
            "+actor_rollout_ref.actor.kl_loss_type=low_var_kl",  # Hydra's '+', verl's value
            "write algorithm.kl_loss_type=k3",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            "write algorithm.policy_loss=ppo",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio=0.2",  # verl's one ratio is both bounds
            "write algorithm.clip_ratio_low=0.2 algorithm.clip_ratio_high=0.2",
        ),
        (
            "trainer.algorithm.loss_reduction=sequence_mean",
            "'trainer.algorithm.loss_reduction' is SkyRL's key: "
            "write algorithm.loss_agg_mode=seq-mean-token-mean",
        ),
        ("trainer.total_training_steps=50", "write trainer.max_steps=50"),
    ],
)
def test_a_peer_key_is_answered_with_the_key_and_value_here(override: str, answer: str) -> None:
    message = _refusal(override)
    assert answer in message
    assert "unknown key" not in message


@pytest.mark.parametrize(
    ("override", "switch"),
    [
        # the key that enables the buffer is its length, not its penalty (the old hint)
        ("algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=N"),
        ("algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.type=filter"),
        ("model.lora.enable=true", "model.lora.rank=R"),
        ("trainer.fully_async.enable=true", "trainer.strategy=fully_async"),
        ("critic.enable=true", "algorithm.advantage_estimator=gae"),
    ],
)
def test_enable_names_the_key_that_turns_the_section_on(override: str, switch: str) -> None:
    message = _refusal(override)
    section = override.rsplit(".", 1)[0]
    assert f"{switch}" in message and f"turns {section} on" in message
    assert "did you mean" not in message


def test_every_bad_key_of_one_command_line_is_reported_at_once() -> None:
    bad = [
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.filter_groups.enable=true",
        "reward_model.overlong_buffer.enable=true",
        "trainer.max_step=10",  # a typo
        "algorithm.kl_loss_coef=-1",  # out of range
        "trainer.train_batch_size=many",  # wrong type
    ]
    lines = _refusal("trainer.max_steps=3", *bad).splitlines()
    assert lines[0] == f"config: {len(bad)} problems"
    problems = lines[1:]
    assert len(problems) == len(bad)
    for override in bad:
        key = override.split("=")[0]
        assert sum(key in line for line in problems) == 1, (key, problems)


def test_the_cli_prints_one_line_per_problem_then_the_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["actor_rollout_ref.actor.clip_ratio_high=0.28", "trainer.max_step=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == "ConfigError: config: 2 problems (above)"
    assert err[-3].strip().startswith("config: 'actor_rollout_ref.actor.clip_ratio_high'")
    assert "trainer.max_steps" in err[-2]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_one_problem_stays_one_line() -> None:
    assert _refusal("trainer.max_step=10") == (
        "config: unknown key 'trainer.max_step' (did you mean 'trainer.max_steps'?)"
    )


@pytest.mark.parametrize("peer", PEER_KEYS, ids=lambda p: f"{p.framework}:{p.key}")
def test_each_peer_key_names_a_key_here_and_translates_to_an_allowed_value(peer) -> None:
    assert peer.ours in KNOWN and all(key in KNOWN for key in peer.also)
    assert peer.key not in KNOWN or peer.key == peer.ours  # else the loader never answers it
    tp = KNOWN[peer.ours]
    for value in (*peer.values.values(), *peer.switch.values()):
        _coerce(peer.ours, value, tp)  # raises ConfigError for a value not allowed here
    if typing.get_origin(tp) is typing.Literal:
        assert not peer.hint  # a named value always carries over


def test_no_peer_key_is_listed_twice() -> None:
    keys = [p.key for p in PEER_KEYS]
    assert len(keys) == len(set(keys))


def test_the_docs_table_is_the_loaders_table() -> None:
    doc = (ROOT / "docs" / "algorithms.md").read_text()
    assert peer_key_table() in doc, (
        "docs/algorithms.md's key table differs from trainer/config/_peer_keys.py: paste "
        "the output of `.venv/bin/python -c 'import trainer.config._peer_keys as p; "
        "p.print_peer_key_table()'`"
    )
