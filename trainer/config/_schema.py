"""The configuration schema: one attrs class per section, one documented field per key.

Each field is made with ``_field(default, doc, check=..., env=...)``
(:func:`trainer.config._fields.config_field`): ``doc`` is what ``python -m trainer --help`` and
docs/configuration.md show, ``check`` returns what is wrong with a value (or None), ``env``
names an environment variable that overrides the key. ``workers`` lives in
:mod:`trainer.config._workers`, ``engine`` and ``sync`` in :mod:`trainer.config._engine`. Loading and validation live in :mod:`trainer.config._load`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    VALUE_ESTIMATORS,
    AdvantageEstimatorName,
    LossAggModeName,
    PolicyLossName,
)
from trainer.config._corrections import RolloutCorrectionConfig
from trainer.config._cov import ClipCovConfig, DroConfig, KlCovConfig
from trainer.config._dapo import DynamicSamplingConfig, OverlongBufferConfig
from trainer.config._data import BUILTIN_REWARDS, DataConfig, ReasoningGymConfig
from trainer.config._distillation import DistillationConfig
from trainer.config._engine import EngineConfig, SyncConfig
from trainer.config._fields import ConfigWarning, at_least, in_range, module_attr, positive
from trainer.config._fields import config_field as _field
from trainer.config._fields import config_section as _section
from trainer.config._kl_in_reward import KlCtrlConfig
from trainer.config._mismatch import MismatchConfig
from trainer.config._models import ModelConfig, OptimConfig
from trainer.config._workers import WorkersConfig

__all__ = [
    "BUILTIN_REWARDS",
    "RENAMED_VALUES",
    "AlgorithmConfig",
    "ConfigWarning",
    "DataConfig",
    "DynamicSamplingConfig",
    "EngineConfig",
    "FullyAsyncConfig",
    "GeneratorConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "ReasoningGymConfig",
    "SamplingConfig",
    "SyncConfig",
    "TrainerConfig",
    "WatchdogConfig",
    "WorkersConfig",
]

#: Values that were renamed: (key, old value) -> what to write instead (a ConfigError says so).
RENAMED_VALUES: dict[tuple[str, str], str] = {
    (
        "sync.transport",
        "broadcast",
    ): "gloo (vLLM's nccl messages over a gloo group, on the CPU; nccl on GPUs)",
}


def _run_dir(v: Any) -> str | None:
    if v is None:
        return None
    if not v.strip():
        return (
            "must name a folder (an empty value, an unset shell variable?); leave the key out "
            "for runs/<timestamp>"
        )
    if "\0" in v:
        return "must not hold a NUL character"
    return None


def _loggers(v: Any) -> str | None:
    if "jsonl" not in v:
        return "must include 'jsonl' (metrics.jsonl is the run's record: resume and plot read it)"
    if len(set(v)) != len(v):
        return "names a logger twice"
    return None


@attrs.define
class WatchdogConfig:
    enabled: bool = _field(
        True,
        "When a step runs past after_s: one line on stderr and in train.log naming the "
        "operation that has gone longest without running, and the run's task tree (what "
        "`debug dump` prints) in train.log; just before a StepTimeoutError, the tree on "
        "stderr too. Nothing is stopped.",
    )
    after_s: float | None = _field(
        None,
        "Seconds a step may run before the watchdog speaks (None: 5x the median step so far, "
        "at least min_s; first_step_s until a step has finished). Once per step.",
        check=positive,
    )
    min_s: float = _field(
        60.0, "The least automatic threshold (after_s=None), in seconds.", check=positive
    )
    first_step_s: float = _field(
        300.0,
        "The automatic threshold until a step has finished (a run's or a resume's first step "
        "loads, compiles and warms up: it is judged by this, not by later steps' median).",
        check=positive,
    )


@attrs.define
class FullyAsyncConfig:
    max_staleness_steps: int = _field(
        4,
        "trainer.strategy=fully_async: how many optimizer steps the policy that sampled a group "
        "may lag the one it trains (0: on-policy, like sync, but generation overlaps training); "
        "admission keeps groups within it and an older group is dropped, never trained on. "
        "Must be >= sync_interval - 1.",
        check=at_least(0),
    )
    sync_interval: int = _field(
        1,
        "trainer.strategy=fully_async: sync weights to the engines every this many steps "
        "(and after the last), while rollouts continue.",
        check=at_least(1),
    )


@attrs.define
class TrainerConfig:
    max_steps: int | None = _field(
        200, "Stop after this many steps (None: run all `epochs`).", check=at_least(1)
    )
    epochs: int = _field(
        100, "Passes over the training prompts (max_steps usually stops first).", check=at_least(1)
    )
    train_batch_size: int = _field(
        16, "Prompts per step (each sampled n_samples_per_prompt times).", check=at_least(1)
    )
    policy_mini_batch_size: int | None = _field(
        None,
        "Prompts per optimizer step; must divide train_batch_size (None: one optimizer step per batch).",
        check=at_least(1),
    )
    micro_batch_size: int | None = _field(
        None,
        "Trajectories per forward/backward pass, accumulated (None: the whole mini-batch at once).",
        check=at_least(1),
    )
    micro_batch_max_tokens: int | None = _field(
        None,
        "Pack the policy's and the reference's forward/backward passes by tokens instead: at "
        "most this many padded tokens (rows times the pass's longest prompt + response) per "
        "pass, longest trajectories first, and at most micro_batch_size rows if that is set "
        "too; a trajectory longer than this goes alone in its pass. verl's "
        "use_dynamic_bsz with ppo_max_token_len_per_gpu, named after micro_batch_size, whose "
        "limit it adds, as one key (None: off). Same gradient; each pass is padded only to "
        "its own longest row either way. The critic passes by micro_batch_size.",
        check=at_least(1),
    )
    update_epochs: int = _field(
        1, "Passes of policy updates over each step's batch (PPO epochs).", check=at_least(1)
    )
    seed: int = _field(0, "Seed for data order, sampling and initialisation.")
    strategy: Literal["sync", "fully_async"] = _field(
        "sync",
        "Step strategy: 'sync' generates, trains and syncs weights in turn; 'fully_async' keeps "
        "generator.num_parallel_workers rollouts running while the policy trains, within "
        "trainer.fully_async.max_staleness_steps (see docs/async.md).",
    )
    run_dir: str | None = _field(
        None,
        "Run directory, made with mode 0700 where the run makes it (None: runs/<timestamp>).",
        check=_run_dir,
    )
    step_timeout_s: float | None = _field(
        None,
        "Budget of one step, generation through weight sync; past it the step fails with "
        "StepTimeoutError naming stage and operation (None: unbounded). Under "
        "trainer.strategy=fully_async it is also each rollout's bound unless "
        "generator.rollout_timeout_s is set.",
        check=positive,
    )
    weight_sync_timeout_s: float | None = _field(
        None,
        "Budget of each weight sync, including the initial one; must be <= step_timeout_s "
        "(None: bounded only by the step).",
        check=positive,
    )
    ckpt_interval: int = _field(
        0, "Save a checkpoint every this many steps and at the end (0: never).", check=at_least(0)
    )
    resume_mode: Literal["none", "latest", "path"] = _field(
        "none", "'latest': continue from run_dir's latest checkpoint; 'path': from resume_path."
    )
    resume_path: str | None = _field(None, "Checkpoint directory for resume_mode=path.")
    max_ckpts_to_keep: int | None = _field(
        3, "Keep this many newest checkpoints (None: all).", check=at_least(1)
    )
    eval_interval: int = _field(
        0,
        "Evaluate on the eval prompts (data.eval, or the task's) every this many steps (0: "
        "never), after the step, under its own step_timeout_s: greedy, eval/reward_mean.",
        check=at_least(0),
    )
    eval_before_train: bool = _field(
        False,
        "Also evaluate after the first weight sync, before step 1 (logged as step 0; a resumed "
        "run does not repeat it).",
    )
    eval_n_samples_per_prompt: int = _field(
        0,
        "Each eval also samples this many responses per eval prompt with generator.sampling: "
        "eval/sampled_reward_mean (0: greedy only).",
        check=at_least(0),
    )
    progress: bool = _field(
        True,
        "Show start-up phases with their times and the step bar (ETA, reward, loss, KL) on "
        "stderr: live in a terminal, plain lines elsewhere.",
    )
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow"], ...] = _field(
        ("jsonl",),
        "Where each step's metrics go: 'jsonl' (RUN_DIR/metrics.jsonl, the run's record; always "
        "on, so always listed) plus any of 'tensorboard', 'wandb', 'mlflow', each an optional "
        "extra (pip install 'trainer[wandb]'); see docs/quickstart.md#trackers.",
        check=_loggers,
    )
    project_name: str = _field(
        "trainer", "The wandb project and the MLflow experiment the trackers log to."
    )
    run_name: str | None = _field(
        None, "The run's name in the trackers (None: the run directory's name)."
    )
    wandb_mode: Literal["offline", "online"] = _field(
        "offline",
        "'offline' writes RUN_DIR/wandb/ only (no network, no account; upload later with "
        "`wandb sync`); 'online' streams to the wandb server (needs `wandb login`).",
    )
    mlflow_tracking_uri: str | None = _field(
        None,
        "Where the mlflow logger writes (None: $MLFLOW_TRACKING_URI if set, else "
        "sqlite:///RUN_DIR/mlflow.db); e.g. http://host:5000 for an MLflow server.",
    )
    interrupt_grace_s: float = _field(
        60.0,
        "After Ctrl-C the run stops cleanly (engines and workers stopped, checkpoints left "
        "consistent); if it has not within this many seconds it is killed, as by a second Ctrl-C.",
        check=positive,
    )
    max_processes_per_core: int = _field(
        8,
        "The most processes of one kind the run starts on this machine per CPU it may use "
        "(engine servers and their tensor-parallel ranks, data.reward_workers, the policy "
        "actors of a Ray cluster the run starts); more is refused at load. Raise it to "
        "oversubscribe the CPUs on purpose.",
        check=at_least(1),
    )
    watchdog: WatchdogConfig = _section(
        WatchdogConfig, "The hang watchdog: a dump of where a long step waits."
    )
    fully_async: FullyAsyncConfig = _section(
        FullyAsyncConfig,
        "trainer.strategy=fully_async: staleness and weight-sync cadence.",
        switch="trainer.strategy=fully_async",
    )

    @property
    def one_update_per_batch(self) -> bool:
        """Whether each batch gets exactly one optimizer step: one mini-batch, one epoch. Its
        old logprobs are then the update's own forward's (no separate ``forward`` of the
        policy), and ``policy/approx_kl`` is 0."""
        one_mini_batch = self.policy_mini_batch_size in (None, self.train_batch_size)
        return self.update_epochs == 1 and one_mini_batch


@attrs.define
class SamplingConfig:
    temperature: float = _field(
        1.0, "Sampling temperature (also applied to the trainer's logprobs).", check=positive
    )
    top_p: float = _field(1.0, "Nucleus sampling mass.", check=in_range(1e-6, 1.0))
    max_tokens: int = _field(4, "Most tokens per generation call.", check=at_least(1))


@attrs.define
class GeneratorConfig:
    cls: str = _field(
        "trainer.generators.agent_loop:AgentLoopGenerator",
        "Generator class as 'module:Class' (subclass of trainer.generators.Generator).",
        check=module_attr,
    )
    n_samples_per_prompt: int = _field(
        8, "Trajectories sampled per prompt (the GRPO group size).", check=at_least(1)
    )
    max_turns: int = _field(1, "Most model turns per trajectory (agent loop).", check=at_least(1))
    num_parallel_workers: int = _field(
        16,
        "trainer.strategy=fully_async: prompt groups rolled out at once, each by its own task "
        "(one generator.generate call of n_samples_per_prompt trajectories).",
        check=at_least(1),
    )
    rollout_timeout_s: float | None = _field(
        None,
        "trainer.strategy=fully_async: seconds one group's rollout (its generator.generate "
        "call, weight-sync pauses included) may take; past it the rollout is cancelled, logged, "
        "counted in async/rollouts_timed_out and its prompt handed out again; a prompt cut off "
        "3 times in a row ends the run with RolloutTimeoutError (None: trainer.step_timeout_s "
        "when that is set, else unbounded). The synchronous loop has no per-rollout bound: "
        "there generation is bounded by the step's budget.",
        check=positive,
    )
    max_response_tokens: int = _field(
        64,
        "Most response tokens per trajectory across turns (env tokens included).",
        check=at_least(1),
    )
    kwargs: dict[str, object] = _field(
        attrs.Factory(dict),
        "Extra keyword arguments for the generator class's constructor "
        "(generator.kwargs.NAME=VALUE, or a mapping in YAML); a name the constructor does not "
        "take fails at start-up.",
    )
    sampling: SamplingConfig = _section(SamplingConfig, "Sampling parameters.")

    @property
    def response_budget(self) -> int:
        """The most response tokens a trajectory can have: ``max_response_tokens``, and with
        one turn no more than ``sampling.max_tokens`` (what a length-based algorithm measures
        against)."""
        if self.max_turns == 1:
            return min(self.max_response_tokens, self.sampling.max_tokens)
        return self.max_response_tokens


@attrs.define
class AlgorithmConfig:
    advantage_estimator: AdvantageEstimatorName = _field(
        ADVANTAGE_ESTIMATORS.names[0],
        "Advantage estimator (docs/algorithms.md): " + ", ".join(ADVANTAGE_ESTIMATORS.names) + ".",
    )
    norm_adv_by_std: bool = _field(
        True, "grpo, grpo_passk: divide by the group's reward std (false: Dr. GRPO)."
    )
    gamma: float = _field(
        1.0,
        "reinforce_plus_plus, gae: the discount per trained token of the outcome reward.",
        check=in_range(0, 1),
    )
    lam: float = _field(
        1.0,
        "gae: GAE's lambda, the bias-variance trade-off of the critic's advantages (1: the "
        "return less the value; 0: the one-step TD error).",
        check=in_range(0, 1),
    )
    policy_loss: PolicyLossName = _field(
        POLICY_LOSSES.names[0],
        "Policy loss (docs/algorithms.md): ppo (PPO-clip, clip-higher, dual-clip), gspo "
        "(sequence-level ratio), cispo (clipped, stop-gradient importance weight), clip_cov, "
        "kl_cov (covariance-guided), dro (quadratic penalty on the log-ratio, Tinker's).",
    )
    loss_agg_mode: LossAggModeName | None = _field(
        None,
        "How per-token losses become one (docs/algorithms.md): "
        + ", ".join(LOSS_AGG_MODES.names)
        + "; None: the policy loss's own (gspo: seq-mean-token-mean, else token-mean).",
    )
    loss_scale_factor: int | None = _field(
        None,
        "loss_agg_mode=seq-mean-token-sum-norm: the constant length each sequence's loss is "
        "divided by (Dr. GRPO); None: the response budget (generator.max_response_tokens; "
        "with one turn at most generator.sampling.max_tokens).",
        check=at_least(1),
    )
    clip_ratio_low: float = _field(
        0.2, "PPO clip: lower bound is 1 - clip_ratio_low.", check=in_range(0, 1)
    )
    clip_ratio_high: float = _field(
        0.28,
        "PPO clip: upper bound is 1 + clip_ratio_high (above clip_ratio_low, as DAPO's clip-higher, "
        "to keep exploring: with 0.2 the tiny default model collapses to one answer per prompt).",
        check=at_least(0),
    )
    clip_ratio_c: float | None = _field(
        3.0,
        "policy_loss=ppo: dual-clip, the largest ratio a negative-advantage token's loss grows "
        "with (must be > 1, as verl's default); None: off.",
        check=lambda v: None if v is None or v > 1 else "must be > 1",
    )
    use_kl_loss: bool = _field(
        False, "Add a KL penalty to a frozen reference model (loads a ref worker)."
    )
    kl_loss_coef: float = _field(0.001, "Weight of the KL penalty.", check=at_least(0))
    kl_loss_type: Literal["k1", "k2", "k3", "abs"] = _field("k3", "KL estimator.")
    use_kl_in_reward: bool = _field(
        False,
        "Subtract kl_ctrl's beta times each token's KL (old policy to a frozen reference "
        "model, by kl_penalty) from its reward before the advantages (verl's; loads a ref "
        "worker). docs/algorithms.md#kl-in-the-reward.",
    )
    kl_penalty: Literal["k1", "k2", "k3", "abs"] = _field(
        "k1", "use_kl_in_reward: the KL estimator (verl's default kl is k1)."
    )
    kl_ctrl: KlCtrlConfig = _section(
        KlCtrlConfig, "use_kl_in_reward: the KL's coefficient, fixed or adaptive (verl's)."
    )
    entropy_coeff: float = _field(
        0.0,
        "The entropy bonus: loss -= entropy_coeff * the entropy of the sampling distribution, "
        "aggregated by loss_agg_mode (verl's actor.entropy_coeff; 0: off, no entropy computed). "
        "policy/entropy reports it.",
        check=at_least(0),
    )
    off_policy_correction: Literal["auto", "none", "tis"] = _field(
        "auto",
        "'auto': 'tis' under trainer.strategy=fully_async, 'none' under sync. 'tis' weighs each token's PPO-clip term by min(exp(old_logprobs - rollout_logprobs), "
        "tis_cap) (truncated importance sampling): use it with fully-async training or any run "
        "whose sampler lags the trainer (engines serving older weights). 'none' ignores the gap "
        "(right for sync runs, where the engine samples with the trained weights); "
        "algorithm.rollout_correction.* chooses among more corrections. Either way "
        "policy/is_ratio_{mean,max,min} report how off-policy the batch is; see "
        "docs/concepts.md#off-policy-correction.",
    )
    tis_cap: float | None = _field(
        2.0,
        "off_policy_correction=tis: the largest importance weight (policy/is_truncated_frac is "
        "the share of tokens it caps); None: no cap, the decoupled PPO objective.",
        check=at_least(1),
    )
    clip_cov: ClipCovConfig = _section(
        ClipCovConfig,
        "policy_loss=clip_cov's parameters (verl's actor.policy_loss.clip_cov_*).",
    )
    kl_cov: KlCovConfig = _section(
        KlCovConfig,
        "policy_loss=kl_cov's parameters (verl's kl_cov_ratio and ppo_kl_coef).",
    )
    dro: DroConfig = _section(DroConfig, "policy_loss=dro's parameter (Tinker's beta).")
    rollout_correction: RolloutCorrectionConfig = _section(
        RolloutCorrectionConfig,
        "Rollout corrections (verl's names): importance weights, rejection masks, bypass mode.",
    )
    mismatch: MismatchConfig = _section(
        MismatchConfig,
        "When the mismatch diagnostics (mismatch/*) warn: their thresholds.",
    )
    distillation: DistillationConfig = _section(
        DistillationConfig,
        "On-policy distillation: a teacher scores the sampled tokens, the advantage is the "
        "negative reverse KL.",
        switch="algorithm.distillation.teacher_path=DIR (the teacher model)",
    )
    overlong_buffer: OverlongBufferConfig = _section(
        OverlongBufferConfig,
        "DAPO's soft overlong punishment of the reward.",
        switch="algorithm.overlong_buffer.len=N (the buffer's length in tokens; 0 is off)",
    )
    dynamic_sampling: DynamicSamplingConfig = _section(
        DynamicSamplingConfig,
        "DAPO's dynamic sampling: train only on informative groups.",
        switch="algorithm.dynamic_sampling.type=filter (none is off)",
    )

    @property
    def trains_critic(self) -> bool:
        """Whether the run has a critic: its advantage estimator reads values (``gae``)."""
        return self.advantage_estimator in VALUE_ESTIMATORS
