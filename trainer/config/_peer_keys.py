"""verl's and SkyRL's names for this trainer's keys: the one table the loader answers a peer's
key from and docs/algorithms.md shows (tests/docs/test_peer_keys_doc.py holds the docs to it).

A user coming from verl writes ``actor_rollout_ref.actor.clip_ratio_high=0.28``; the loader
(:func:`trainer.config._load.load_config`) answers with this trainer's key and the value
translated (``write algorithm.clip_ratio_high=0.28``) instead of "unknown key". A peer key is
never taken silently: one concept keeps one name here, and the user's command line learns it.

Each :class:`PeerKey` maps one peer key to one key here, with the peer's values that have
another name here (``low_var_kl`` is ``k3``). ``value`` fixes the value here where the peer's
key is a switch (verl's ``algorithm.filter_groups.enable=true`` is
``algorithm.dynamic_sampling.type=filter``); ``hint`` says what to write where no value
translates (verl's ``overlong_buffer.enable`` becomes a buffer length).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

__all__ = [
    "PEER_KEYS",
    "PeerKey",
    "peer_answer",
    "peer_key_table",
    "peer_value_answer",
    "print_peer_key_table",
]

Framework = Literal["verl", "SkyRL"]


@attrs.frozen
class PeerKey:
    """One peer key and this trainer's key for it."""

    framework: Framework
    key: str
    ours: str
    #: the peer's values whose name differs here (the rest are written as given)
    values: Mapping[str, str] = attrs.field(factory=dict)
    #: the value here whatever the peer's (a switch), keyed by the peer's value as YAML reads it
    switch: Mapping[str, str] = attrs.field(factory=dict)
    #: what to write where the value does not carry over (shown instead of a value)
    hint: str = ""
    #: further keys here that take the same value (verl's one ``clip_ratio`` is both bounds)
    also: tuple[str, ...] = ()

    def answer(self, value: object) -> str:
        """``write OURS=VALUE`` for the peer's ``value`` (or the hint where none carries over)."""
        text = _yaml_text(value)
        if self.switch:
            if text in self.switch:
                return f"write {self.ours}={self.switch[text]}"
            return f"set {self.ours} ({', '.join(sorted(set(self.switch.values())))})"
        if self.hint:
            return f"write {self.ours}={self.hint}"
        text = self.values.get(text, text)
        return "write " + " ".join(f"{key}={text}" for key in (self.ours, *self.also))


def _yaml_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_yaml_text(v) for v in value) + "]"
    return str(value)


_KL = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
_ON_OFF_FILTER = {"true": "filter", "false": "none"}
_BUFFER_LEN = "N (the buffer's length in tokens; 0 is off)"
_A = "actor_rollout_ref.actor"
_S = "trainer.algorithm"
_R = "algorithm.rollout_correction"


def _verl(key: str, ours: str, **kw: object) -> PeerKey:
    return PeerKey("verl", key, ours, **kw)  # type: ignore[arg-type]


def _skyrl(key: str, ours: str, **kw: object) -> PeerKey:
    return PeerKey("SkyRL", key, ours, **kw)  # type: ignore[arg-type]


#: Every peer key the loader answers (docs/algorithms.md, "The keys in verl and SkyRL").
PEER_KEYS: tuple[PeerKey, ...] = (
    _verl("algorithm.adv_estimator", "algorithm.advantage_estimator"),
    _skyrl(f"{_S}.advantage_estimator", "algorithm.advantage_estimator"),
    _verl("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    _skyrl(f"{_S}.grpo_norm_by_std", "algorithm.norm_adv_by_std"),
    _verl("algorithm.gamma", "algorithm.gamma"),
    _skyrl(f"{_S}.gamma", "algorithm.gamma"),
    _verl("algorithm.lam", "algorithm.lam"),
    _skyrl(f"{_S}.lambd", "algorithm.lam"),
    _verl("critic.model.path", "critic.model.path"),
    _skyrl("trainer.critic.model.path", "critic.model.path"),
    _verl("critic.optim.lr", "critic.optim.lr"),
    _verl("critic.optim.lr_warmup_steps", "critic.optim.warmup_steps"),
    _skyrl("trainer.critic.optimizer_config.lr", "critic.optim.lr"),
    _skyrl("trainer.critic.optimizer_config.num_warmup_steps", "critic.optim.warmup_steps"),
    _verl("critic.cliprange_value", "critic.value_clip"),
    _skyrl(f"{_S}.value_clip", "critic.value_clip"),
    _verl("trainer.critic_warmup", "critic.warmup_steps"),
    _verl(f"{_A}.policy_loss.loss_mode", "algorithm.policy_loss", values={"vanilla": "ppo"}),
    _skyrl(
        f"{_S}.policy_loss_type",
        "algorithm.policy_loss",
        values={"regular": "ppo", "dual_clip": "ppo"},
    ),
    _verl(f"{_A}.clip_ratio", "algorithm.clip_ratio_low", also=("algorithm.clip_ratio_high",)),
    _verl(f"{_A}.clip_ratio_low", "algorithm.clip_ratio_low"),
    _verl(f"{_A}.clip_ratio_high", "algorithm.clip_ratio_high"),
    _skyrl(f"{_S}.eps_clip_low", "algorithm.clip_ratio_low"),
    _skyrl(f"{_S}.eps_clip_high", "algorithm.clip_ratio_high"),
    _skyrl(f"{_S}.cispo.cispo_eps_clip_low", "algorithm.clip_ratio_low"),
    _skyrl(f"{_S}.cispo.cispo_eps_clip_high", "algorithm.clip_ratio_high"),
    _verl(f"{_A}.clip_ratio_c", "algorithm.clip_ratio_c"),
    _skyrl(f"{_S}.clip_ratio_c", "algorithm.clip_ratio_c"),
    _verl(f"{_A}.policy_loss.clip_cov_ratio", "algorithm.clip_cov.ratio"),
    _verl(f"{_A}.policy_loss.clip_cov_lb", "algorithm.clip_cov.lb"),
    _verl(f"{_A}.policy_loss.clip_cov_ub", "algorithm.clip_cov.ub"),
    _verl(f"{_A}.policy_loss.kl_cov_ratio", "algorithm.kl_cov.ratio"),
    _verl(f"{_A}.policy_loss.ppo_kl_coef", "algorithm.kl_cov.coef"),
    _verl(f"{_A}.loss_agg_mode", "algorithm.loss_agg_mode"),
    _skyrl(
        f"{_S}.loss_reduction",
        "algorithm.loss_agg_mode",
        values={
            "token_mean": "token-mean",
            "sequence_mean": "seq-mean-token-mean",
            "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
        },
    ),
    _verl(f"{_A}.loss_scale_factor", "algorithm.loss_scale_factor"),
    _skyrl(f"{_S}.max_seq_len", "algorithm.loss_scale_factor"),
    _verl(f"{_A}.use_kl_loss", "algorithm.use_kl_loss"),
    _skyrl(f"{_S}.use_kl_loss", "algorithm.use_kl_loss"),
    _verl(f"{_A}.kl_loss_coef", "algorithm.kl_loss_coef"),
    _skyrl(f"{_S}.kl_loss_coef", "algorithm.kl_loss_coef"),
    _verl(f"{_A}.kl_loss_type", "algorithm.kl_loss_type", values=_KL),
    _skyrl(f"{_S}.kl_estimator_type", "algorithm.kl_loss_type"),
    _verl("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    _skyrl(f"{_S}.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    _verl("algorithm.kl_penalty", "algorithm.kl_penalty", values=_KL),
    _verl("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type"),
    _skyrl(f"{_S}.kl_ctrl.type", "algorithm.kl_ctrl.type"),
    _verl("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    _verl("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl"),
    _skyrl(f"{_S}.kl_ctrl.kl_target", "algorithm.kl_ctrl.target_kl"),
    _verl("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon"),
    _skyrl(f"{_S}.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon"),
    _verl(f"{_A}.entropy_coeff", "algorithm.entropy_coeff"),
    _skyrl(f"{_S}.entropy_loss_coef", "algorithm.entropy_coeff"),
    _skyrl(
        f"{_S}.use_entropy_loss",
        "algorithm.entropy_coeff",
        hint="C (entropy_loss_coef's value, 0.01 by SkyRL's default; 0 is off)",
    ),
    *(
        _verl(f"{_R}.{leaf}", f"{_R}.{leaf}")
        for leaf in (
            "rollout_is",
            "rollout_is_threshold",
            "rollout_rs",
            "rollout_rs_threshold",
            "bypass_mode",
        )
    ),
    _skyrl(f"{_S}.off_policy_correction.tis_ratio_type", f"{_R}.rollout_is"),
    _skyrl(f"{_S}.off_policy_correction.token_tis_ratio_clip_high", f"{_R}.rollout_is_threshold"),
    _verl(
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable",
        "algorithm.overlong_buffer.len",
        hint=_BUFFER_LEN,
    ),
    _verl("reward_model.overlong_buffer.enable", "algorithm.overlong_buffer.len", hint=_BUFFER_LEN),
    _verl("reward_model.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    _verl("reward_model.overlong_buffer.len", "algorithm.overlong_buffer.len"),
    _verl(
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
        "algorithm.overlong_buffer.penalty",
    ),
    _verl("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_buffer.penalty"),
    _skyrl("overlong_buffer_len", "algorithm.overlong_buffer.len"),
    _skyrl("overlong_buffer_penalty_factor", "algorithm.overlong_buffer.penalty"),
    _verl(
        "algorithm.filter_groups.enable", "algorithm.dynamic_sampling.type", switch=_ON_OFF_FILTER
    ),
    _verl("algorithm.filter_groups.max_num_gen_batches", "algorithm.dynamic_sampling.max_rounds"),
    _skyrl(f"{_S}.dynamic_sampling.type", "algorithm.dynamic_sampling.type"),
    _skyrl(f"{_S}.dynamic_sampling.max_sample_batches", "algorithm.dynamic_sampling.max_rounds"),
    _verl("actor_rollout_ref.rollout.n", "generator.n_samples_per_prompt"),
    _skyrl("generator.n_samples_per_prompt", "generator.n_samples_per_prompt"),
    _verl("data.train_batch_size", "trainer.train_batch_size"),
    _skyrl("trainer.train_batch_size", "trainer.train_batch_size"),
    _verl(f"{_A}.ppo_mini_batch_size", "trainer.policy_mini_batch_size"),
    _skyrl("trainer.policy_mini_batch_size", "trainer.policy_mini_batch_size"),
    _verl(f"{_A}.ppo_micro_batch_size_per_gpu", "trainer.micro_batch_size"),
    _skyrl("trainer.micro_train_batch_size_per_gpu", "trainer.micro_batch_size"),
    _verl(f"{_A}.ppo_epochs", "trainer.update_epochs"),
    _skyrl("trainer.update_epochs_per_batch", "trainer.update_epochs"),
    _verl("trainer.total_training_steps", "trainer.max_steps"),
    _verl("trainer.total_epochs", "trainer.epochs"),
    _verl("trainer.save_freq", "trainer.ckpt_interval"),
    _skyrl("trainer.ckpt_interval", "trainer.ckpt_interval"),
    _verl("trainer.test_freq", "trainer.eval_interval"),
    _verl("trainer.val_before_train", "trainer.eval_before_train"),
    _verl(f"{_A}.optim.lr", "optim.lr"),
    _skyrl("trainer.policy.optimizer_config.lr", "optim.lr"),
    _verl(f"{_A}.optim.lr_warmup_steps", "optim.warmup_steps"),
    _verl(f"{_A}.optim.weight_decay", "optim.weight_decay"),
    _verl(f"{_A}.grad_clip", "optim.max_grad_norm"),
    _skyrl("trainer.policy.optimizer_config.max_grad_norm", "optim.max_grad_norm"),
    _verl("actor_rollout_ref.model.path", "model.path"),
    _skyrl("trainer.policy.model.path", "model.path"),
    _verl("actor_rollout_ref.model.lora_rank", "model.lora.rank"),
    _verl("actor_rollout_ref.model.lora_alpha", "model.lora.alpha"),
    _verl("actor_rollout_ref.model.target_modules", "model.lora.target_modules"),
    _verl("actor_rollout_ref.rollout.temperature", "generator.sampling.temperature"),
    _skyrl("generator.sampling_params.temperature", "generator.sampling.temperature"),
    _verl("actor_rollout_ref.rollout.top_p", "generator.sampling.top_p"),
    _skyrl("generator.sampling_params.top_p", "generator.sampling.top_p"),
    _verl("actor_rollout_ref.rollout.response_length", "generator.sampling.max_tokens"),
    _verl("data.max_response_length", "generator.sampling.max_tokens"),
    _verl("data.max_prompt_length", "data.max_prompt_length"),
    _skyrl("generator.sampling_params.max_generate_length", "generator.sampling.max_tokens"),
    _verl("actor_rollout_ref.rollout.tensor_model_parallel_size", "engine.tensor_parallel_size"),
    _skyrl("generator.inference_engine_tensor_parallel_size", "engine.tensor_parallel_size"),
    _skyrl("generator.num_inference_engines", "engine.num_engines"),
    _verl("actor_rollout_ref.rollout.gpu_memory_utilization", "engine.gpu_memory_utilization"),
    _skyrl("generator.gpu_memory_utilization", "engine.gpu_memory_utilization"),
    _verl("trainer.default_local_dir", "trainer.run_dir"),
    _verl("data.train_files", "data.train"),
    _verl("data.val_files", "data.eval"),
)

_BY_KEY: dict[str, PeerKey] = {p.key: p for p in PEER_KEYS if p.key != p.ours}


def peer_answer(key: str, value: object) -> str | None:
    """The answer to a peer's ``key=value``: ``"verl's key; here ..."``; None for no peer key."""
    peer = _BY_KEY.get(key)
    if peer is None:
        return None
    return f"{key!r} is {peer.framework}'s key: {peer.answer(value)}"


_SAME_KEY_VALUES: dict[tuple[str, str], PeerKey] = {
    (p.key, peer_value): p for p in PEER_KEYS if p.key == p.ours for peer_value in p.values
}


def peer_value_answer(key: str, value: object) -> str | None:
    """The answer to a peer's value of a key both share (verl's ``algorithm.kl_penalty=
    low_var_kl``): ``"verl's value; write ..."``; None for no peer value."""
    peer = _SAME_KEY_VALUES.get((key, _yaml_text(value)))
    if peer is None:
        return None
    return f"{key}={value!r} is {peer.framework}'s value: {peer.answer(value)}"


def print_peer_key_table() -> None:
    """Print :func:`peer_key_table` (what docs/algorithms.md holds)."""
    print(peer_key_table())


def peer_key_table() -> str:
    """The Markdown table of docs/algorithms.md: one row per key here, its verl and SkyRL keys
    (``same`` where the peer's key is this trainer's)."""
    rows: dict[str, dict[str, list[str]]] = {}
    for p in PEER_KEYS:
        if p.key == p.ours:  # the same key here: nothing to translate but renamed values
            same = "same" + (
                " (" + ", ".join(f"`{k}`: `{v}`" for k, v in p.values.items()) + ")"
                if p.values
                else ""
            )
            rows.setdefault(p.ours, {"verl": [], "SkyRL": []})[p.framework].append(same)
            continue
        cell = f"`{p.key}`" + "".join(f" (also `{key}`)" for key in p.also)
        renamed = {**p.values, **p.switch}
        if renamed:
            cell += " (" + ", ".join(f"`{k}`: `{v}`" for k, v in renamed.items()) + ")"
        rows.setdefault(p.ours, {"verl": [], "SkyRL": []})[p.framework].append(cell)
    lines = ["| here | verl | SkyRL |", "|---|---|---|"]
    for ours, cells in rows.items():
        verl = ", ".join(cells["verl"]) or "-"
        skyrl = ", ".join(cells["SkyRL"]) or "-"
        lines.append(f"| `{ours}` | {verl} | {skyrl} |")
    return "\n".join(lines)
