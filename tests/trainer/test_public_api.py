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
        "ckpt_main",
        "load_model",
        "load_state",
        "rng_state",
        "save_model",
        "save_state",
        "set_rng_state",
    ],
    "trainer.config": [
        "Config",
        "ConfigWarning",
        "DataConfig",
        "EngineConfig",
        "help_text",
        "load_config",
        "to_dict",
        "validate_cfg",
    ],
    "trainer.data": [
        "ChatMessage",
        "Example",
        "PromptLoader",
        "RewardFn",
        "RewardFunction",
        "check_same_order",
        "digit_task_reward",
        "epoch_order",
        "exact_match_reward",
        "load_datasets",
        "reward_function",
    ],
    "trainer.debug": [
        "DEBUG_FILE",
        "Dumper",
        "StallInstrument",
        "StallWindow",
        "WaitClock",
        "Watchdog",
        "debug_main",
        "debug_paths",
        "innermost_place",
        "open_debug_services",
        "render",
        "request_dump",
        "serve_debug_socket",
        "stack_signal",
        "task_tree",
        "thread_stacks",
        "tree_of",
        "where_line",
    ],
    "trainer.errors": [
        "CheckpointEngineInitError",
        "CheckpointError",
        "ConfigError",
        "DataError",
        "EngineFailedError",
        "EngineStartError",
        "EngineUnusableError",
        "FaultInjected",
        "InferenceServerError",
        "InferenceServerTimeoutError",
        "RayClusterStartError",
        "RolloutTimeoutError",
        "StepTimeoutError",
        "TrainerError",
        "WeightSyncMismatchError",
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
        "check_generator_kwargs",
    ],
    "trainer.generators.agent_loop": ["AgentLoopGenerator", "EnvStep", "shared_first_turns"],
    "trainer.generators.chat": [
        "chat_turn_ids",
        "check_prompts",
        "prompt_lengths",
        "render_prompt",
    ],
    "trainer.generators.openai_agent": [
        "AgentRuntime",
        "OpenAIAgentGenerator",
        "run_asyncio_agent",
    ],
    "trainer.generators.token_capture": [
        "CaptureProxy",
        "ENGINE_KEEPALIVE_S",
        "PROXY_KEEPALIVE_S",
        "open_capture_proxy",
    ],
    "trainer.generators.turns": ["CapturedTurn", "Sample", "assemble"],
    "trainer.loop": [
        "FullyAsyncStrategy",
        "PromptStream",
        "RunContext",
        "Strategy",
        "SyncStrategy",
        "VersionedEngine",
        "WeightVersions",
        "make_strategy",
        "one_update_per_batch",
        "open_engine_recovery",
        "resync_engines",
        "run_training",
    ],
    "trainer.metrics": [
        "MetricsLogger",
        "StepProgress",
        "TrackerSink",
        "jsonable_row",
        "open_trackers",
        "restore_metrics",
        "reward_summary",
        "setup_run_logging",
        "teardown_run_logging",
    ],
    "trainer.metrics.plots": [
        "EVAL_METRICS",
        "LINE_PLOTS",
        "plot_main",
        "plot_runs",
        "read_evals",
        "read_steps",
    ],
    "trainer.off_policy": [
        "DEFAULT_TIS_CAP",
        "IS_RATIO_METRICS",
        "OFF_POLICY_CORRECTIONS",
        "OffPolicyCorrection",
        "importance_weights",
        "resolve_correction",
    ],
    "trainer.run": ["train", "with_run_dir"],
    "trainer.vocabulary": [
        "AWAIT",
        "Bound",
        "FAULTS_ENV",
        "FAULTS_FIRED_ENV",
        "Fault",
        "FaultAction",
        "Faults",
        "OPERATIONS",
        "Operation",
        "Place",
        "STAGES",
        "Stage",
        "Timer",
        "active_faults",
        "at_step",
        "bounded",
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
        "place_of",
        "raise_first",
        "release_hangs",
        "remaining",
        "set_engine_signaller",
        "stage",
        "step_deadline",
        "unfired_faults",
        "wait_refs",
        "wait_result",
    ],
    "trainer.workers": [],
    "trainer.workers.batch": ["TrainBatch"],
    "trainer.workers.device": ["collective_backend"],
    "trainer.workers.fsdp": ["GatheredModel", "gathered_model", "is_sharded", "shard_model"],
    "trainer.workers.group": ["WorkerGroup"],
    "trainer.workers.local": ["LocalWorkerGroup", "SHUTDOWN_WAIT_S"],
    "trainer.workers.offload": [
        "Offloaded",
        "offload_training_state",
        "restore_training_state",
        "tensor_bytes",
    ],
    "trainer.workers.policy": [
        "OFFLOAD_METRICS",
        "PolicyWorker",
        "RefWorker",
        "preload_model_code",
    ],
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
    "trainer.workers.ray_group": ["RayWorkerGroup"],
    "trainer.workers.ray_placement": ["bundles", "gpus_for", "padded_shard", "shards"],
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
