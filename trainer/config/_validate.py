"""Cross-field validation of a loaded :class:`~trainer.config.Config` (:func:`validate_cfg`):
what no single field's check can see, each a ``ConfigError`` naming the keys involved.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import stat
import sys
import warnings
from urllib.parse import urlsplit

from engines.vllm.flags import ENGINE_ARG_FLAGS, flag_clashes
from sync.registry import TRANSPORTS
from trainer.algorithms import resolve_loss_agg_mode
from trainer.config._config import Config
from trainer.config._cov import check_cov
from trainer.config._distillation import check_distillation
from trainer.config._kl_in_reward import check_kl_in_reward
from trainer.config._models import CriticConfig
from trainer.config._plan import EngineBackend, RunPlan, Strategy, WorkerBackend
from trainer.config._reasoning_gym import check_reasoning_gym
from trainer.config._resources import check_resources
from trainer.config._schema import (
    ConfigWarning,
)
from trainer.errors import ConfigError
from trainer.vocabulary import Fault, parse_faults

__all__ = ["validate_cfg"]


def _unreachable(fault: Fault, cfg: Config, plan: RunPlan) -> str | None:
    """Why ``fault`` can never fire in a run configured as ``cfg`` and planned as ``plan``
    (and what would reach it)."""
    e, t = cfg.engine, cfg.trainer
    backend, bracket = plan.engine_backend, plan.bracket
    op = fault.op
    if fault.steps is not None and t.max_steps is not None and fault.steps[0] > t.max_steps:
        return f"the run ends at trainer.max_steps={t.max_steps}; raise it to reach step {fault.steps[0]}"
    if op == "init_process_group" and (
        not plan.transport.group or backend is EngineBackend.INPROCESS
    ):
        return (
            f"this run builds no weight-sync process group (sync.transport={cfg.sync.transport}, "
            f"engine.backend={e.backend}); set sync.transport=gloo (or nccl) to reach it"
        )
    if fault.action.signals_engine:
        if not backend.starts_servers or e.placement != "process":
            return (
                f"it signals an engine server the trainer started, and engine.backend={e.backend} "
                f"with engine.placement={e.placement} starts none as its child; use "
                "engine.backend=local or vllm with engine.placement=process"
            )
        if fault.engine is not None and fault.engine >= e.num_engines:
            return f"engine {fault.engine} does not exist (engine.num_engines={e.num_engines})"
    if fault.action.skews_sampler and backend not in (
        EngineBackend.LOCAL,
        EngineBackend.INPROCESS,
    ):
        return (
            f"{fault.action.value} makes the reference engine disagree, and "
            f"engine.backend={e.backend} serves another; use engine.backend=local "
            "(or inprocess, for generate) to reach it"
        )
    if op == "/v1/load_lora_adapter" and not (
        backend is EngineBackend.LOCAL and cfg.model.lora.rank > 0 and cfg.sync.lora == "adapter"
    ):
        return (
            "only a LoRA policy's adapter sync loads adapters into the reference engine; set "
            "model.lora.rank=N, sync.lora=adapter and engine.backend=local to reach it"
        )
    if op.startswith("critic_") and not plan.trains_critic:
        return (
            f"this run trains no critic (algorithm.advantage_estimator="
            f"{cfg.algorithm.advantage_estimator}); set algorithm.advantage_estimator=gae to reach it"
        )
    if op == "forward" and not plan.recomputes_old_logprobs and not plan.uses_reference_model:
        return (
            "with one update per batch (trainer.update_epochs=1, one mini-batch) the old "
            "logprobs come from the update's own forward_backward, and without "
            "algorithm.use_kl_loss there is no reference model to run; target forward_backward, "
            "or set trainer.update_epochs=2 (or trainer.policy_mini_batch_size) to reach it"
        )
    if op.startswith("/") and backend in (EngineBackend.VLLM, EngineBackend.REMOTE):
        return (
            f"route faults fire inside the engine servers the project runs (the reference "
            f"engine, or vLLM in process), and engine.backend={e.backend} talks to a vLLM "
            "server that never reads them; use engine.backend=local, inprocess or "
            "vllm_inprocess to reach it"
        )
    if op == "save_checkpoint" and t.ckpt_interval <= 0:
        return "this run saves no checkpoint; set trainer.ckpt_interval=N to reach it"
    if op in ("/sleep", "/wake_up") and not bracket.sleeps:
        return (
            "weight syncs pause the engines instead of sleeping them; set "
            "engine.offload_kv_for_weight_sync=true or engine.colocated=true to reach it"
        )
    if op == "wait_for_batch" and plan.strategy is not Strategy.FULLY_ASYNC:
        return (
            "only trainer.strategy=fully_async waits for a batch of rollouts; the synchronous "
            "loop generates its own (target generate instead)"
        )
    if op in ("/pause", "/resume") and not bracket.pauses:
        return (
            "weight syncs sleep the engines instead of pausing them (engine.colocated or "
            "engine.offload_kv_for_weight_sync); set both to false to reach it"
        )
    if op == "/reset_prefix_cache" and not bracket.resets_prefix_cache:
        return (
            "weight syncs sleep the engines (engine.colocated or "
            "engine.offload_kv_for_weight_sync), which clears their caches without it; set both "
            "to false to reach it"
        )
    transfer_routes = (
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    )
    if op in transfer_routes and backend is EngineBackend.INPROCESS:
        return (
            "engine.backend=inprocess takes weights in memory; use engine.backend=local to reach it"
        )
    return None


def _check_reachable(fault: Fault, cfg: Config, plan: RunPlan) -> None:
    reason = _unreachable(fault, cfg, plan)
    if reason is not None:
        raise ConfigError(f"config: faults={str(fault)!r} can never fire: {reason}")


def _check_fully_async(cfg: Config) -> None:
    if cfg.trainer.strategy != "fully_async":
        return
    fa = cfg.trainer.fully_async
    if fa.max_staleness_steps < fa.sync_interval - 1:
        raise ConfigError(
            f"config: trainer.fully_async.max_staleness_steps={fa.max_staleness_steps} is out of "
            f"range: must be >= trainer.fully_async.sync_interval - 1 = {fa.sync_interval - 1} "
            "(between two syncs the engines' policy falls that many steps behind, so no group "
            "could be admitted and the run would wait forever)"
        )
    if cfg.engine.colocated:
        raise ConfigError(
            "config: engine.colocated=true cannot be combined with trainer.strategy='fully_async': "
            "colocated engines sleep while the policy trains, and fully-async generation runs "
            "during training; give generation its own devices (engine.colocated=false)"
        )


def _check_rollout_timeout(cfg: Config) -> None:
    """A rollout bound set for the synchronous loop would bound nothing: say so."""
    bound = cfg.generator.rollout_timeout_s
    if bound is not None and cfg.trainer.strategy != "fully_async":
        warnings.warn(
            f"generator.rollout_timeout_s={bound:g} applies to trainer.strategy=fully_async only; "
            "the synchronous loop bounds generation by the step's budget "
            "(trainer.step_timeout_s)",
            ConfigWarning,
            stacklevel=3,
        )


#: The config key behind each engine field the trainer sets as a ``vllm serve`` flag.
_ENGINE_FIELD_KEYS = {
    "model": "model.path",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "seed": "trainer.seed",
    "enable_sleep_mode": "engine.colocated or engine.offload_kv_for_weight_sync",
    "weight_transfer_config": "sync.transport",
    "enable_lora": "model.lora.enabled with sync.lora=adapter",
    "max_lora_rank": "model.lora.rank, with sync.lora=adapter",
    "max_loras": "model.lora.enabled with sync.lora=adapter",
}
# every flag the trainer sets has the key that sets it: a flag added to ENGINE_ARG_FLAGS without
# one here fails at import, not as a KeyError in the middle of a user's config check
if set(_ENGINE_FIELD_KEYS) != set(ENGINE_ARG_FLAGS):
    raise RuntimeError(
        "trainer.config._validate._ENGINE_FIELD_KEYS must name the config key of each field of "
        f"engines.vllm.flags.ENGINE_ARG_FLAGS: {sorted(set(ENGINE_ARG_FLAGS) ^ set(_ENGINE_FIELD_KEYS))}"
    )


def _check_vllm(cfg: Config) -> None:
    """vLLM backends: tensor parallelism only where vLLM runs, one GPU's buffer for ipc, and
    ``engine.extra_args`` that leave the trainer's own flags alone.

    Every ``sync.transport`` reaches vLLM: ``nccl`` and ``ipc`` are vLLM's own, ``gloo`` and
    ``disk`` the project's vLLM plugin (:mod:`engines.vllm`)."""
    e = cfg.engine
    vllm = e.backend in ("vllm", "vllm_inprocess")
    if vllm and (clashes := flag_clashes(e.extra_args)):
        keys = ", ".join(f"{field} ({_ENGINE_FIELD_KEYS[field]})" for field in clashes)
        raise ConfigError(
            f"config: engine.extra_args={list(e.extra_args)} set what the trainer sets from its "
            f"own keys: {keys}; set those keys instead and drop the flags from engine.extra_args"
        )
    if TRANSPORTS[cfg.sync.transport].same_gpu and e.tensor_parallel_size != 1:
        raise ConfigError(
            f"config: sync.transport='ipc' hands the engine one GPU's buffer, so "
            f"engine.tensor_parallel_size={e.tensor_parallel_size} is out of range: use 1, or "
            "sync.transport=nccl for a tensor-parallel engine"
        )
    if not vllm and e.tensor_parallel_size != 1:
        raise ConfigError(
            f"config: engine.tensor_parallel_size={e.tensor_parallel_size} applies to vLLM "
            f"engines (engine.backend=vllm or vllm_inprocess), not engine.backend={e.backend!r}"
        )


def _exposed_engine(cfg: Config) -> str | None:
    """Where the run's engines answer beyond this host: ``engine.placement=ray`` (each server
    binds its node's address), or a ``backend=remote`` URL that is not loopback; None: all on
    this host's loopback."""
    e = cfg.engine
    if e.backend in ("local", "vllm") and e.placement == "ray":
        return "engine.placement='ray' binds each server to its node's address"
    if e.backend == "remote":
        for url in e.urls:
            host = (urlsplit(url).hostname or "").strip("[]")
            try:
                loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                return f"engine.urls has {url!r}, not this host's loopback"
    return None


def _check_pickle_exposure(cfg: Config) -> None:
    """``sync.transport=ipc`` with vLLM needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: its
    ``/update_weights`` unpickles what it is sent. Refused where that route answers beyond
    this host, unless ``engine.trust_network`` says the network is trusted."""
    if cfg.sync.transport != "ipc" or cfg.engine.trust_network:
        return
    if cfg.engine.backend not in ("vllm", "remote"):
        return
    if (exposed := _exposed_engine(cfg)) is not None:
        raise ConfigError(
            f"config: sync.transport='ipc' makes vLLM unpickle what /update_weights is sent "
            f"(VLLM_ALLOW_INSECURE_SERIALIZATION=1), and {exposed}: anyone who reaches it and "
            "has the key runs code there. Keep the engines on this host (engine.placement="
            "process), use sync.transport=nccl, or set engine.trust_network=true if only "
            "trusted hosts reach this network (docs/security.md)"
        )


def _check_fork_server(cfg: Config) -> None:
    """``engine.fork_server`` names a listening socket where the run starts reference servers
    as child processes (elsewhere it is not used, so not checked)."""
    e = cfg.engine
    if e.fork_server is None or e.backend != "local" or e.placement != "process":
        return
    if not stat.S_ISSOCK(os.stat(e.fork_server).st_mode if os.path.exists(e.fork_server) else 0):
        raise ConfigError(
            f"config: engine.fork_server={e.fork_server!r} (env TRAINER_FORK_SERVER) is not a "
            "socket: start one with `python -m engines.launch.fork_server --socket "
            f"{e.fork_server} --preload engines.local.__main__`, or unset it"
        )


def _check_algorithm(cfg: Config) -> None:
    a, g = cfg.algorithm, cfg.generator
    try:
        resolve_loss_agg_mode(a.policy_loss, a.loss_agg_mode)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    check_cov(a)
    check_kl_in_reward(a)
    if a.advantage_estimator == "grpo_passk" and g.n_samples_per_prompt < 2:
        raise ConfigError(
            "config: algorithm.advantage_estimator='grpo_passk' rewards the best of a group "
            f"over the second best, but generator.n_samples_per_prompt={g.n_samples_per_prompt}: "
            "set it to 2 or more"
        )
    if a.dynamic_sampling.type == "filter" and g.n_samples_per_prompt < 2:
        raise ConfigError(
            "config: algorithm.dynamic_sampling.type='filter' keeps groups whose rewards differ, "
            "but with generator.n_samples_per_prompt=1 no group can: set it to 2 or more"
        )
    if not a.trains_critic and cfg.critic != CriticConfig():
        raise ConfigError(
            f"config: critic.* is set, but algorithm.advantage_estimator={a.advantage_estimator!r} "
            "trains no critic: set algorithm.advantage_estimator=gae (PPO with a critic), or "
            "leave critic.* at its defaults"
        )
    steps = cfg.trainer.max_steps
    if a.trains_critic and steps is not None and cfg.critic.warmup_steps >= steps:
        raise ConfigError(
            f"config: critic.warmup_steps={cfg.critic.warmup_steps} is out of range: the policy "
            f"waits that many steps and the run has trainer.max_steps={steps}, so it would never "
            "train; lower critic.warmup_steps"
        )
    if a.overlong_buffer.len > g.response_budget:
        raise ConfigError(
            f"config: algorithm.overlong_buffer.len={a.overlong_buffer.len} is out of range: "
            f"must be <= the response budget, {g.response_budget} tokens "
            "(generator.max_response_tokens; with one turn at most generator.sampling.max_tokens)"
        )


def _check_sharded_checkpoints(cfg: Config, plan: RunPlan) -> None:
    t, w = cfg.trainer, cfg.workers
    if plan.sharded and (t.ckpt_interval > 0 or t.resume_mode != "none"):
        why = "'fsdp2'" if w.data_parallel == "fsdp2" else "'auto', which shards on CUDA,"
        raise ConfigError(
            f"config: workers.data_parallel={why} cannot save or resume checkpoints yet "
            f"(trainer.ckpt_interval={t.ckpt_interval}, trainer.resume_mode={t.resume_mode!r}); "
            "use workers.data_parallel=replicate for a run with checkpoints"
        )


def _check_lora(cfg: Config) -> None:
    """``model.lora``: peft installed where an adapter is asked for."""
    if cfg.model.lora.enabled and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            f"config: model.lora.rank={cfg.model.lora.rank} trains a LoRA adapter with peft, "
            f"which is not installed in this Python ({sys.executable}): `bash setup.sh` (and "
            "`bash setup.sh --vllm`) install it (the `lora` extra: pip install -e '.[lora]'), "
            "or set model.lora.rank=0 for full fine-tuning"
        )


def validate_cfg(cfg: Config) -> None:
    """Cross-field checks; raises ConfigError, warns (ConfigWarning) on suspicious budgets.

    The budget warning fires only where the run has a torch.distributed group whose watchdog
    (``workers.collective_timeout_s``) a shorter budget would pre-empt: Ray workers, or the
    broadcast weight transport to HTTP engines. Local workers with the disk transport have none.
    """
    t = cfg.trainer
    ws, st = t.weight_sync_timeout_s, t.step_timeout_s
    if ws is not None and st is not None and ws > st:
        raise ConfigError(
            f"config: trainer.weight_sync_timeout_s={ws:g} is out of range: "
            f"must be <= trainer.step_timeout_s={st:g}"
        )
    if t.policy_mini_batch_size is not None and t.train_batch_size % t.policy_mini_batch_size:
        raise ConfigError(
            f"config: trainer.policy_mini_batch_size={t.policy_mini_batch_size} is out of range: "
            f"must divide trainer.train_batch_size={t.train_batch_size}"
        )
    _check_fully_async(cfg)
    _check_rollout_timeout(cfg)
    if cfg.engine.backend == "remote" and not cfg.engine.urls:
        raise ConfigError(
            "config: engine.backend='remote' needs engine.urls=[http://HOST:PORT,...]"
        )
    if cfg.engine.placement == "ray" and cfg.engine.backend not in ("local", "vllm"):
        raise ConfigError(
            f"config: engine.placement='ray' places the servers the trainer starts, but "
            f"engine.backend={cfg.engine.backend!r} starts none; use engine.backend=local or vllm"
        )
    _check_vllm(cfg)
    _check_pickle_exposure(cfg)
    _check_fork_server(cfg)
    _check_algorithm(cfg)
    check_distillation(cfg)
    if cfg.sync.transport != "disk" and cfg.engine.backend == "inprocess":
        raise ConfigError(
            f"config: sync.transport={cfg.sync.transport!r} sends weights to engine servers, but "
            "engine.backend='inprocess' has none (it takes the weights in memory); use "
            f"engine.backend=local for {cfg.sync.transport}, or leave sync.transport at its default"
        )
    w = cfg.workers
    if w.backend == "local" and w.num_policy_workers != 1:
        raise ConfigError(
            f"config: workers.num_policy_workers={w.num_policy_workers} is out of range: "
            "workers.backend='local' runs exactly 1 policy worker (use workers.backend=ray for "
            "data parallel)"
        )
    if t.resume_mode == "path" and not t.resume_path:
        raise ConfigError("config: trainer.resume_mode='path' needs trainer.resume_path=DIR")
    if cfg.data.overlong_prompts == "drop" and cfg.data.max_prompt_length is None:
        raise ConfigError(
            "config: data.overlong_prompts='drop' drops the prompts longer than "
            "data.max_prompt_length, which is unset: set data.max_prompt_length=TOKENS"
        )
    check_reasoning_gym(cfg.data.reasoning_gym, cfg.data.task)
    _check_lora(cfg)
    plan = cfg.plan  # the decisions this machine cannot honour fail here, at load
    check_resources(cfg, plan)  # what the config starts, against what the machine has
    _check_sharded_checkpoints(cfg, plan)
    if cfg.faults:
        for fault in parse_faults(cfg.faults):
            _check_reachable(fault, cfg, plan)
    collective = plan.timeouts.collective_s
    uses_collectives = plan.worker_backend is WorkerBackend.RAY or (
        plan.transport.group and plan.engine_backend is not EngineBackend.INPROCESS
    )
    for key, budget in (
        ("trainer.step_timeout_s", t.step_timeout_s),
        ("trainer.weight_sync_timeout_s", t.weight_sync_timeout_s),
    ):
        if uses_collectives and budget is not None and budget < collective:
            warnings.warn(
                f"{key}={budget:g} is below the collective timeout in use "
                f"(workers.collective_timeout_s={collective:g}): a stuck collective will surface as "
                "a step timeout naming the stage, before torch's own watchdog can name the collective",
                ConfigWarning,
                stacklevel=2,
            )
