"""``trainer``'s public names, pinned (a change to them is a decision, not an accident)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import trainer

#: Every public module of ``trainer`` and its ``__all__``; private (``_x``) modules are not listed.
PUBLIC = {
    "trainer": [],
    "trainer.__main__": ["main"],
    "trainer.algorithms": [
        "ADVANTAGE_ESTIMATORS",
        "DEFAULT_CLIP_HIGH",
        "DEFAULT_CLIP_LOW",
        "KL_ESTIMATORS",
        "POLICY_LOSS_METRICS",
        "compute_advantages",
        "kl_penalty",
        "masked_mean",
        "masked_sum",
        "policy_loss",
        "token_logprobs",
    ],
    "trainer.checkpoint": [
        "CheckpointError",
        "CheckpointManager",
        "LATEST_FILE",
        "MANIFEST_FILE",
        "RESUME_MODES",
        "STEP_DIR_PREFIX",
        "TMP_PREFIX",
        "TRAINER_STATE_FILE",
        "load_model",
        "load_state",
        "rng_state",
        "save_model",
        "save_state",
        "set_rng_state",
    ],
    "trainer.checkpoint_format": [
        "LATEST_FILE",
        "MANIFEST_FILE",
        "MANIFEST_FORMAT",
        "STEP_DIR_PREFIX",
        "TMP_PREFIX",
        "TRAINER_STATE_FILE",
        "is_complete",
        "parse_step_dir_name",
        "read_trainer_state",
        "step_dirs",
        "verify",
        "write_manifest",
    ],
    "trainer.checkpoint_inspect": ["CheckpointInfo", "list_checkpoints"],
    "trainer.checkpoint_io": [
        "files_under",
        "fsync_dir",
        "load_model",
        "load_state",
        "remove_path",
        "rng_state",
        "save_model",
        "save_state",
        "set_rng_state",
        "sha256_file",
        "write_text_synced",
    ],
    "trainer.ckpt_cli": ["ckpt_main"],
    "trainer.config": [
        "help_text",
        "iter_fields",
        "load_config",
        "to_dict",
        "type_name",
        "validate_cfg",
    ],
    "trainer.config_schema": [
        "AlgorithmConfig",
        "Config",
        "ConfigWarning",
        "DataConfig",
        "EngineConfig",
        "GeneratorConfig",
        "ModelConfig",
        "OptimConfig",
        "SamplingConfig",
        "SyncConfig",
        "TrainerConfig",
        "WorkersConfig",
    ],
    "trainer.data": [
        "Example",
        "PromptLoader",
        "RewardFn",
        "TASKS",
        "digit_task_reward",
        "exact_match_reward",
        "load_examples",
        "load_jsonl",
        "modular_sum_examples",
        "resolve_reward_fn",
        "task_examples",
    ],
    "trainer.debug": ["StallInstrument"],
    "trainer.errors": [
        "CheckpointEngineInitError",
        "CheckpointError",
        "ConfigError",
        "DataError",
        "EngineStartError",
        "FaultInjected",
        "InferenceServerError",
        "InferenceServerTimeoutError",
        "RayClusterStartError",
        "RefFailed",
        "StepTimeoutError",
        "WeightSyncTimeoutError",
        "WorkerError",
    ],
    "trainer.generators": [
        "AgentLoopGenerator",
        "EngineClient",
        "EnvStep",
        "Generator",
        "GeneratorInput",
        "GeneratorOutput",
        "Trajectory",
        "TrajectoryInput",
    ],
    "trainer.generators.agent_loop": ["AgentLoopGenerator", "EnvStep", "shared_first_turns"],
    "trainer.generators.base": [
        "EngineClient",
        "Generator",
        "GeneratorInput",
        "GeneratorOutput",
        "Trajectory",
        "TrajectoryInput",
    ],
    "trainer.loop": ["run_eval", "run_step", "run_training", "sync_weights"],
    "trainer.metrics": [
        "MetricsLogger",
        "StepProgress",
        "reward_summary",
        "setup_run_logging",
        "teardown_run_logging",
    ],
    "trainer.parts": [
        "make_transport",
        "open_engine",
        "open_ray_cluster",
        "open_transport",
        "open_workers",
        "uses_ray",
    ],
    "trainer.run": ["train"],
    "trainer.run_context": ["RunContext", "SLOW_STALL_MS"],
    "trainer.stages": [
        "advantages_for",
        "evaluate",
        "generator_input",
        "make_batch",
        "rollout_metrics",
        "save_checkpoint",
        "train_policy",
    ],
    "trainer.vocabulary": [
        "AWAIT",
        "FAULTS_ENV",
        "FAULTS_FIRED_ENV",
        "Fault",
        "FaultAction",
        "Faults",
        "OPERATIONS",
        "Operation",
        "STAGES",
        "Stage",
        "Timer",
        "active_faults",
        "at_step",
        "cleanup_bracket",
        "cleanup_preserving_primary",
        "current_deadline",
        "current_operation",
        "current_stage",
        "current_step",
        "exception_leaves",
        "fire_fault",
        "fire_fault_sync",
        "install_faults",
        "open_owner_nursery",
        "operation",
        "parse_faults",
        "pending_deadline_error",
        "raise_first",
        "release_hangs",
        "remaining",
        "stage",
        "step_deadline",
        "unfired_faults",
        "wait_refs",
        "wait_result",
    ],
    "trainer.workers": [],
    "trainer.workers.batch": ["TrainBatch"],
    "trainer.workers.group": ["WorkerGroup"],
    "trainer.workers.local": ["LocalWorkerGroup"],
    "trainer.workers.policy": ["PolicyWorker", "RefWorker"],
    "trainer.workers.ray_actor": ["PolicyActor", "RefActor"],
    "trainer.workers.ray_cluster": [
        "ACTOR_ENV_VARS",
        "actor_env",
        "init_kwargs",
        "open_cluster",
        "prepare_env",
        "start_cluster",
        "stop_cluster",
    ],
    "trainer.workers.ray_group": ["RayWorkerGroup", "shards"],
}


def _public_modules() -> list[str]:
    found = pkgutil.walk_packages(trainer.__path__, "trainer.")
    names = [
        m.name
        for m in found
        if not any(p.startswith("_") and p != "__main__" for p in m.name.split("."))
    ]
    return sorted(["trainer", *names])


def test_every_public_module_is_pinned():
    assert _public_modules() == sorted(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_all_is_pinned_and_every_name_exists(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == PUBLIC[name]
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
