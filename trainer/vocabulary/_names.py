"""The names of DESIGN 4.3, spelled once: the stages of a step and the operations it awaits.

Config validation, fault specs, ``stage()``/``operation()``, metrics (``timing/<stage>``) and
the docs all use these names. A misspelt stage is a type error (``Stage``) and, like a
misspelt operation, a ``ValueError`` at run time.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["OPERATIONS", "STAGES", "Operation", "Stage"]

Stage = Literal[
    "generate",
    "fwd_logprobs_values_reward",
    # algorithm.distillation only: the teacher scores the sampled tokens
    "teacher_logprobs",
    "compute_advantages",
    "train_critic_and_policy",
    "save_checkpoints",
    "sync_weights",
    "eval",
    # fully-async only
    "wait_for_generation_buffer",
    "run_training",
]

Operation = Literal[
    "generate",
    "env_step",
    # algorithm.distillation only: one sequence's prompt logprobs from the teacher's engine
    "teacher_logprobs",
    "forward",
    "forward_backward",
    "optim_step",
    # the critic's (algorithm.advantage_estimator=gae): its values, its update
    "critic_forward",
    "critic_forward_backward",
    "critic_optim_step",
    "offload_to_cpu",
    "backload_to_gpu",
    "broadcast_to_inference_engines",
    # points inside a transfer, fired on the trainer's side (so against any engine), once per
    # sync: after /start_weight_update and the first /update_weights, and before the finish
    "transfer_after_first_bucket",
    "transfer_before_finish",
    "init_process_group",
    "save_checkpoint",
    # fully-async only: the trainer's wait for a batch of finished rollout groups
    "wait_for_batch",
    # control-plane endpoints, by their path
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    # a LoRA policy's sync of its adapter (sync.lora=adapter), by vLLM's path
    "/v1/load_lora_adapter",
]

#: Every stage, in step order (``Stage``'s values).
STAGES: tuple[Stage, ...] = get_args(Stage)
#: Every operation a deadline can name and a fault can target (``Operation``'s values).
OPERATIONS: tuple[Operation, ...] = get_args(Operation)
