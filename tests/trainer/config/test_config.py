"""Configuration: every class of bad input stops the run at load with one clear line."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import yaml

from trainer.config import Config, ConfigWarning
from trainer.config._load import iter_fields, load_config, to_dict
from trainer.errors import ConfigError


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.max_step=3"],
            "config: unknown key 'trainer.max_step' (did you mean 'trainer.max_steps'?)",
        ),
        (["nonsense.key=1"], "config: unknown key 'nonsense.key'; see `python -m trainer --help`"),
        # a key like no other of its section gets no guess ('trainer.epochs' was offered)
        (["trainer.foo=1"], "config: unknown key 'trainer.foo'; see `python -m trainer --help`"),
        (
            ["trainr.max_steps=3"],  # a misspelled section
            "config: unknown key 'trainr.max_steps' (did you mean 'trainer.max_steps'?)",
        ),
        (
            ["+trainer.max_steps=3"],  # verl's (Hydra's) way of adding a key
            "config: '+trainer.max_steps': '+' adds or removes a key in Hydra; here every key "
            "exists already and none can be added, write trainer.max_steps=VALUE without it",
        ),
        (
            ["+trainer.foo=1"],
            "config: '+trainer.foo': '+' adds or removes a key in Hydra; here every key exists "
            "already and none can be added, and 'trainer.foo' is not a key (see `python -m "
            "trainer --help`)",
        ),
        (
            ["trainer=3"],
            "config: trainer is a section, not a value; set its keys (trainer.KEY=...)",
        ),
        (
            ["trainer.max_steps=abc"],
            "config: trainer.max_steps='abc' has the wrong type: expected int | None",
        ),
        (["trainer.progress=7"], "config: trainer.progress=7 has the wrong type: expected bool"),
        (
            ["trainer.loggers=[wandb]"],
            "config: trainer.loggers=('wandb',) is out of range: must include 'jsonl' "
            "(metrics.jsonl is the run's record: resume and plot read it)",
        ),
        (
            ["trainer.loggers=[jsonl,neptune]"],
            "config: trainer.loggers='neptune' is not allowed: choose one of 'jsonl', "
            "'tensorboard', 'wandb', 'mlflow'",
        ),
        (
            ["optim.betas=[0.9]"],
            "config: optim.betas=[0.9] has the wrong type: expected tuple[float, float]",
        ),
        (["trainer.max_steps=0"], "config: trainer.max_steps=0 is out of range: must be >= 1"),
        (["optim.lr=-1"], "config: optim.lr=-1.0 is out of range: must be > 0"),
        (
            ["trainer.step_timeout_s=0"],
            "config: trainer.step_timeout_s=0.0 is out of range: must be > 0",
        ),
        (
            ["generator.rollout_timeout_s=0"],
            "config: generator.rollout_timeout_s=0.0 is out of range: must be > 0",
        ),
        (
            ["generator.sampling.top_p=1.5"],
            "config: generator.sampling.top_p=1.5 is out of range: must be in [1e-06, 1]",
        ),
        (
            ["engine.pause_mode=freeze"],
            "config: engine.pause_mode='freeze' is not allowed: choose one of 'keep', 'abort', 'wait'",
        ),
        (
            ["algorithm.advantage_estimator=ppo"],
            "config: algorithm.advantage_estimator='ppo' is not allowed: choose one of 'grpo', 'rloo', "
            "'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'grpo_passk', 'gae'",
        ),
        (
            ["generator.cls=nocolon"],
            "config: generator.cls='nocolon' is out of range: must be 'package.module:Name'",
        ),
        (
            ["trainer.step_timeout_s=5000", "trainer.weight_sync_timeout_s=6000"],
            "config: trainer.weight_sync_timeout_s=6000 is out of range: must be <= trainer.step_timeout_s=5000",
        ),
        (
            ["trainer.train_batch_size=16", "trainer.policy_mini_batch_size=5"],
            "config: trainer.policy_mini_batch_size=5 is out of range: must divide trainer.train_batch_size=16",
        ),
        (
            ["trainer.resume_mode=path"],
            "config: trainer.resume_mode='path' needs trainer.resume_path=DIR",
        ),
        (["trainer.max_steps"], "config: override 'trainer.max_steps' is not key=value"),
        (
            ["engine.placement=ray", "engine.backend=inprocess"],
            "config: engine.placement='ray' places the servers the trainer starts, but "
            "engine.backend='inprocess' starts none; use engine.backend=local or vllm",
        ),
        (
            ["engine.placement=node"],
            "config: engine.placement='node' is not allowed: choose one of 'process', 'ray'",
        ),
    ],
)
def test_bad_config_is_one_line_naming_key_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_bad_fault_spec_is_rejected_at_load():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["faults=forward_backwrd:hang"])
    assert "forward_backwrd" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["faults=init_process_group:hang"], "set sync.transport=gloo (or nccl) to reach it"),
        (
            ["faults=/sleep:hang@2"],
            "set engine.offload_kv_for_weight_sync=true or engine.colocated=true",
        ),
        (["faults=/pause:hang", "engine.colocated=true"], "set both to false to reach it"),
        (["faults=save_checkpoint:error=disk full"], "set trainer.ckpt_interval=N to reach it"),
        (["faults=forward:hang@50", "trainer.max_steps=10"], "raise it to reach step 50"),
        (
            ["faults=/update_weights:hang", "engine.backend=inprocess"],
            "use engine.backend=local to reach it",
        ),
        # one update per batch: the old logprobs are the update's own, no reference model
        (["faults=forward:hang@2"], "target forward_backward, or set trainer.update_epochs=2"),
        (["faults=forward:error=boom@2", "trainer.policy_mini_batch_size=8"], None),
        # a vLLM server never reads the trainer's faults
        (
            [
                "faults=/update_weights:error=boom@2",
                "engine.backend=remote",
                "engine.urls=[http://h:1]",
            ],
            "engine.backend=remote talks to a vLLM server that never reads them",
        ),
    ],
)
def test_a_fault_the_run_can_never_reach_is_refused_naming_the_setting_that_would(
    overrides, reason
):
    if reason is None:  # the same fault, reached by the setting after it
        assert load_config(None, overrides).faults == overrides[0].removeprefix("faults=")
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "can never fire" in message and reason in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "overrides",
    [
        ["faults=init_process_group:hang", "sync.transport=gloo"],
        ["faults=/sleep:hang@2", "engine.offload_kv_for_weight_sync=true"],
        ["faults=/pause:hang@2,forward:hang@10", "trainer.max_steps=10", "trainer.update_epochs=2"],
        ["faults=forward:hang@2", "algorithm.use_kl_loss=true"],  # the reference model's forward
        ["faults=save_checkpoint:error=disk full", "trainer.ckpt_interval=5"],
    ],
)
def test_a_fault_the_run_reaches_is_accepted(overrides):
    assert load_config(None, overrides).faults == overrides[0].removeprefix("faults=")


def test_yaml_file_then_overrides_then_env(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"trainer": {"max_steps": 7, "seed": 3}, "optim": {"lr": 0.01}}))
    monkeypatch.setenv("TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S", "5")
    cfg = load_config(f, ["trainer.seed=4", "engine.control_plane_timeout_s=100"])
    assert (cfg.trainer.max_steps, cfg.trainer.seed, cfg.optim.lr) == (7, 4, 0.01)
    assert cfg.engine.control_plane_timeout_s == 5.0  # the env var overrides


def test_yaml_file_problems_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError, match=r"did you mean 'trainer.max_steps'"):
        load_config(typo)


@pytest.mark.parametrize("collectives", ["workers.backend=ray", "sync.transport=gloo"])
def test_budget_below_collective_timeout_warns_where_a_collective_runs(collectives):
    with pytest.warns(
        ConfigWarning, match=r"trainer.step_timeout_s=20 is below the collective timeout"
    ):
        load_config(None, ["trainer.step_timeout_s=20", collectives])


def test_budgets_of_a_run_without_collectives_draw_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(None, ["trainer.step_timeout_s=20", "trainer.weight_sync_timeout_s=10"])


def test_a_rollout_bound_under_the_synchronous_loop_warns_that_it_bounds_nothing():
    with pytest.warns(
        ConfigWarning,
        match=r"generator.rollout_timeout_s=30 applies to trainer.strategy=fully_async only",
    ):
        load_config(None, ["generator.rollout_timeout_s=30"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(None, ["trainer.strategy=fully_async", "generator.rollout_timeout_s=30"])


def test_resolved_config_round_trips_through_yaml():
    cfg = load_config(None, ["trainer.max_steps=3", "optim.betas=[0.8,0.9]"])
    again = load_config(
        None, [f"{k}={v}" for k, v in _flat(to_dict(cfg)).items() if v is not None and v != ""]
    )
    assert again == cfg


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else v
    return out


def test_every_field_has_a_docstring():
    for key, attribute, _tp in iter_fields(Config):
        assert attribute.metadata.get("doc"), f"{key} has no doc"


def test_help_lists_every_key_with_default_and_doc():
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for key, attribute, _tp in iter_fields(Config):
        assert f"  {key} = " in out, key
        assert attribute.metadata["doc"] in out


def test_cli_bad_config_exits_2_with_the_message_last():
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "trainer.max_step=3"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "ConfigError: config: unknown key 'trainer.max_step' (did you mean 'trainer.max_steps'?)"
    )


def test_an_argument_list_takes_numbers_as_written() -> None:
    """engine.extra_args=[--max-model-len,4096]: YAML reads 4096 as an int; a flag list wants
    it as the string it was written as (a bool stays a type error)."""
    cfg = load_config(None, ["engine.extra_args=[--max-model-len,4096,--x,0.5]"])
    assert cfg.engine.extra_args == ("--max-model-len", "4096", "--x", "0.5")
    with pytest.raises(ConfigError, match="wrong type"):
        load_config(None, ["engine.extra_args=[--flag,true]"])


def test_vllm_extra_args_may_not_set_what_the_trainer_sets_from_its_own_keys() -> None:
    """Both vLLM backends build their flags from the config (engines.vllm.flags); a flag in
    engine.extra_args that sets one of them is refused at load, naming the key to set."""
    vllm = ["engine.backend=vllm", "sync.transport=gloo"]
    with pytest.raises(ConfigError, match=r"seed \(trainer.seed\)") as info:
        load_config(None, [*vllm, "engine.extra_args=[--seed,3,-tp,2]"])
    assert "tensor_parallel_size (engine.tensor_parallel_size)" in str(info.value)
    with pytest.raises(ConfigError, match=r"weight_transfer_config \(sync.transport\)"):
        load_config(None, ["engine.backend=vllm_inprocess", "sync.transport=gloo",
                           "engine.extra_args=[--weight-transfer-config.backend=ipc]"])  # fmt: skip
    # the LoRA flags too (a KeyError, not this line, until 2026-12-08)
    with pytest.raises(
        ConfigError, match=r"max_lora_rank \(model.lora.rank, with sync.lora=adapter\)"
    ):
        load_config(None, [*vllm, "engine.extra_args=[--max-lora-rank,8]"])
    with pytest.raises(ConfigError, match=r"enable_lora \(.*\), max_loras \("):
        load_config(None, [*vllm, "engine.extra_args=[--enable-lora,--max-loras,2]"])
    cfg = load_config(None, [*vllm, "engine.extra_args=[--max-model-len,4096]"])
    assert cfg.engine.extra_args == ("--max-model-len", "4096")
