"""The configuration tree: attrs classes, loaded from YAML plus ``key.sub=value`` overrides.

Every field carries its documentation (``doc``) and, where a value can be out of range, a
``check``; ``python -m trainer --help`` prints them all. Loading validates everything before
any work starts: an unknown key (with a close-match hint), a wrong type, a value out of range
or an inconsistent combination raises ``ConfigError`` with one line naming the key, the value
and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml
from omegaconf import OmegaConf

from trainer.errors import ConfigError

__all__ = ["Config", "ConfigWarning", "iter_fields", "load_config", "to_dict", "validate_cfg"]

Check = Callable[[Any], str | None]


class ConfigWarning(UserWarning):
    """A configuration that works but is probably not what was meant."""


def _field(default: Any, doc: str, *, check: Check | None = None, env: str | None = None) -> Any:
    return attrs.field(default=default, metadata={"doc": doc, "check": check, "env": env})


def _section(cls: type, doc: str) -> Any:
    return attrs.field(factory=cls, metadata={"doc": doc})


def at_least(lo: float) -> Check:
    return lambda v: None if v is None or v >= lo else f"must be >= {lo:g}"


def positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def in_range(lo: float, hi: float) -> Check:
    return lambda v: None if v is None or lo <= v <= hi else f"must be in [{lo:g}, {hi:g}]"


def module_attr(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and v.count(":") == 1 and all(v.split(":"))):
        return None
    return "must be 'package.module:Name'"


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
    update_epochs: int = _field(
        1, "Passes of policy updates over each step's batch (PPO epochs).", check=at_least(1)
    )
    seed: int = _field(0, "Seed for data order, sampling and initialisation.")
    strategy: Literal["sync"] = _field(
        "sync",
        "Step strategy: 'sync' generates, trains and syncs weights in turn (fully_async lands later).",
    )
    run_dir: str | None = _field(None, "Run directory (None: runs/<timestamp>).")
    step_timeout_s: float | None = _field(
        None,
        "Budget of one step, generation through weight sync; past it the step fails with "
        "StepTimeoutError naming stage and operation (None: unbounded).",
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
        "Evaluate on data.eval every this many steps (0: never). Not bounded by step_timeout_s.",
        check=at_least(0),
    )
    progress: bool = _field(True, "Show the live progress display.")


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
    max_response_tokens: int = _field(
        64,
        "Most response tokens per trajectory across turns (env tokens included).",
        check=at_least(1),
    )
    sampling: SamplingConfig = _section(SamplingConfig, "Sampling parameters.")


@attrs.define
class EngineConfig:
    backend: Literal["local", "remote", "inprocess"] = _field(
        "local",
        "Inference engines: 'local' starts CPU reference servers (vLLM's HTTP protocol) and stops "
        "them at exit; 'remote' uses servers at engine.urls (e.g. `vllm serve`); 'inprocess' runs "
        "the reference engine inside the trainer, without HTTP.",
    )
    num_engines: int = _field(1, "Servers to start (backend=local).", check=at_least(1))
    urls: tuple[str, ...] = _field(
        (), "Server base URLs for backend=remote, e.g. [http://host:8000]."
    )
    api_key: str | None = _field(
        None, "Bearer token for the servers (also given to servers we start)."
    )
    pause_mode: Literal["keep", "abort", "wait"] = _field(
        "keep", "How generation pauses for a weight sync: keep (freeze), abort, wait (drain)."
    )
    colocated: bool = _field(
        False,
        "The engines share devices with training: a weight sync wakes the weights, transfers, "
        "then wakes the KV cache (instead of pause/transfer/resume).",
    )
    offload_kv_for_weight_sync: bool = _field(
        False,
        "Free the KV cache during a weight sync: sleep, wake the weights, transfer, wake the "
        "KV cache (always, even when the transfer fails).",
    )
    max_concurrency: int = _field(
        256, "Most generation requests in flight at once.", check=at_least(1)
    )
    startup_timeout_s: float = _field(
        180.0, "How long started servers may take to become healthy.", check=positive
    )
    control_plane_timeout_s: float = _field(
        600.0,
        "Per-request timeout of control-plane calls (pause, resume, sleep, weight transfer), "
        "inside or outside a step; <= 0 disables. Generation requests are not bounded by it.",
        env="TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S",
    )


@attrs.define
class SyncConfig:
    transport: Literal["disk", "broadcast"] = _field(
        "disk",
        "How weights reach HTTP engines: 'disk' writes safetensors buckets the engines load "
        "(same machine or shared mount); 'broadcast' sends them over a torch.distributed group "
        "(gloo) from policy rank 0 to every server. backend=inprocess always hands tensors "
        "over in memory.",
    )
    bucket_size_mb: int = _field(
        256, "Largest weight bucket per transfer call, in MB.", check=at_least(1)
    )
    group_init_timeout_s: float = _field(
        600.0,
        "sync.transport=broadcast: how long the weight-sync process group may take to form "
        "before CheckpointEngineInitError (bounded by the trainer, not inside a worker).",
        check=positive,
        env="TRAINER_GROUP_INIT_TIMEOUT_S",
    )


@attrs.define
class WorkersConfig:
    backend: Literal["local", "ray"] = _field(
        "local",
        "Where policy/ref workers run: 'local' (threads in this process) or 'ray' (Ray actors, "
        "data parallel over num_policy_workers; see docs/scaling.md).",
    )
    num_policy_workers: int = _field(
        1,
        "Data-parallel policy workers (backend=ray; the local backend runs exactly one).",
        check=at_least(1),
    )
    ray_address: str | None = _field(
        None,
        "backend=ray: the cluster to join ('auto' or HOST:PORT); None starts a local cluster "
        "for this run and stops it at exit.",
    )
    ray_init_retries: int = _field(
        3,
        "backend=ray: extra attempts to start the local cluster when ray.init fails "
        "(cluster start-up only; never retries a step).",
        check=at_least(0),
    )
    collective_timeout_s: float = _field(
        1800.0,
        "Timeout of torch.distributed collectives (the process group's own watchdog).",
        check=positive,
    )


@attrs.define
class ModelConfig:
    path: str | None = _field(
        None, "Hugging Face causal-LM directory (None: the built-in tiny model)."
    )


@attrs.define
class AlgorithmConfig:
    advantage_estimator: Literal["grpo", "rloo"] = _field("grpo", "Advantage estimator.")
    norm_adv_by_std: bool = _field(True, "GRPO: divide by the group's reward std.")
    clip_ratio_low: float = _field(
        0.2, "PPO clip: lower bound is 1 - clip_ratio_low.", check=in_range(0, 1)
    )
    clip_ratio_high: float = _field(
        0.28,
        "PPO clip: upper bound is 1 + clip_ratio_high (above clip_ratio_low, as DAPO's clip-higher, "
        "to keep exploring: with 0.2 the tiny default model collapses to one answer per prompt).",
        check=at_least(0),
    )
    use_kl_loss: bool = _field(
        False, "Add a KL penalty to a frozen reference model (loads a ref worker)."
    )
    kl_loss_coef: float = _field(0.001, "Weight of the KL penalty.", check=at_least(0))
    kl_loss_type: Literal["k1", "k2", "k3", "abs"] = _field("k3", "KL estimator.")


@attrs.define
class OptimConfig:
    lr: float = _field(1e-3, "AdamW learning rate.", check=positive)
    weight_decay: float = _field(0.0, "AdamW weight decay.", check=at_least(0))
    betas: tuple[float, float] = _field((0.9, 0.99), "AdamW betas.")
    max_grad_norm: float = _field(1.0, "Gradient clipping norm.", check=positive)
    warmup_steps: int = _field(
        0, "Linear learning-rate warm-up, in optimizer steps.", check=at_least(0)
    )


@attrs.define
class DataConfig:
    train: str | None = _field(
        None, "Training prompts, a JSONL file of {prompt, answer} rows (None: the built-in task)."
    )
    eval: str | None = _field(None, "Evaluation prompts, same format.")
    reward_fn: str | None = _field(
        None,
        "Reward function 'module:function' (response: str, answer: str) -> float (None: the task's).",
        check=module_attr,
    )
    task: Literal["max_digit", "modular_sum"] = _field(
        "max_digit", "Built-in task when data.train is None (see docs/concepts.md)."
    )
    num_examples: int = _field(512, "Prompts the built-in task generates.", check=at_least(1))


@attrs.define
class Config:
    trainer: TrainerConfig = _section(TrainerConfig, "The step loop.")
    generator: GeneratorConfig = _section(GeneratorConfig, "Rollout generation.")
    engine: EngineConfig = _section(EngineConfig, "Inference engines.")
    sync: SyncConfig = _section(SyncConfig, "Weight sync from the policy to the engines.")
    workers: WorkersConfig = _section(WorkersConfig, "Policy and reference workers.")
    model: ModelConfig = _section(ModelConfig, "The policy model.")
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "Advantages and losses.")
    optim: OptimConfig = _section(OptimConfig, "Optimizer.")
    data: DataConfig = _section(DataConfig, "Prompts and rewards.")
    faults: str = _field(
        "",
        "Fault injection 'OP:ACTION[@STEPS],...' to rehearse timeouts (see docs/troubleshooting.md).",
        env="TRAINER_FAULTS",
    )


# ---------------------------------------------------------------------------------------------


def iter_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, attrs.Attribute, Any]]:
    """Yield (dotted key, attribute, resolved type) for every leaf field."""
    hints = typing.get_type_hints(cls)
    for a in attrs.fields(cls):
        key = f"{prefix}{a.name}"
        tp = hints[a.name]
        if attrs.has(tp):
            yield from iter_fields(tp, key + ".")
        else:
            yield key, a, tp


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(x) for x in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(t) for t in typing.get_args(tp))
    if origin is tuple:
        return f"tuple[{', '.join('...' if t is Ellipsis else _type_name(t) for t in typing.get_args(tp))}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    wrong = ConfigError(f"config: {key}={value!r} has the wrong type: expected {_type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for t in args:
            if t is type(None):
                continue
            try:
                return _coerce(key, value, t)
            except ConfigError:
                continue
        raise wrong
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"config: {key}={value!r} is not allowed: choose one of {', '.join(map(repr, allowed))}"
            )
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            if isinstance(value, str):  # engine.urls=http://a:8000 (one item)
                value = [value]
            if not isinstance(value, list | tuple):
                raise wrong
            return tuple(_coerce(key, v, args[0]) for v in value)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise wrong
        return tuple(_coerce(key, v, t) for v, t in zip(value, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise wrong
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong
    raise wrong


def _flatten(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flatten(v, key + ".")
        else:
            yield key, v


def _build(values: dict[str, Any]) -> Config:
    known = {key: (a, tp) for key, a, tp in iter_fields()}
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    leaves: dict[str, Any] = {}
    for key, value in _flatten(values):
        if key not in known:
            if key in sections:
                raise ConfigError(
                    f"config: {key} is a section, not a value; set its keys ({key}.KEY=...)"
                )
            hint = difflib.get_close_matches(key, list(known), n=1)
            tail = f" (did you mean {hint[0]!r}?)" if hint else "; see `python -m trainer --help`"
            raise ConfigError(f"config: unknown key {key!r}{tail}")
        leaves[key] = value
    for key, (a, _tp) in known.items():
        env = a.metadata.get("env")
        if env and os.environ.get(env) not in (None, ""):
            leaves[key] = yaml.safe_load(os.environ[env]) if key != "faults" else os.environ[env]
    for key, value in leaves.items():
        a, tp = known[key]
        value = _coerce(key, value, tp)
        check = a.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(f"config: {key}={value!r} is out of range: {problem}")
        leaves[key] = value
    return _assemble(Config, leaves, "")


def _assemble(cls: type, leaves: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for a in attrs.fields(cls):
        key = f"{prefix}{a.name}"
        if attrs.has(hints[a.name]):
            kwargs[a.name] = _assemble(hints[a.name], leaves, key + ".")
        elif key in leaves:
            kwargs[a.name] = leaves[key]
    return cls(**kwargs)


def validate_cfg(cfg: Config) -> None:
    """Cross-field checks; raises ConfigError, warns (ConfigWarning) on suspicious budgets."""
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
    if cfg.engine.backend == "remote" and not cfg.engine.urls:
        raise ConfigError(
            "config: engine.backend='remote' needs engine.urls=[http://HOST:PORT,...]"
        )
    w = cfg.workers
    if w.backend == "local" and w.num_policy_workers != 1:
        raise ConfigError(
            f"config: workers.num_policy_workers={w.num_policy_workers} is out of range: "
            "workers.backend='local' runs exactly 1 policy worker (use workers.backend=ray for "
            "data parallel)"
        )
    if cfg.sync.transport == "broadcast" and w.backend != "local":
        raise ConfigError(
            f"config: sync.transport='broadcast' needs workers.backend='local' (policy rank 0 "
            f"joins the group in the trainer's process), got workers.backend={w.backend!r}; "
            "use sync.transport=disk"
        )
    if t.resume_mode == "path" and not t.resume_path:
        raise ConfigError("config: trainer.resume_mode='path' needs trainer.resume_path=DIR")
    if cfg.faults:
        from trainer.faults import parse_faults

        parse_faults(cfg.faults)
    collective = cfg.workers.collective_timeout_s
    for key, budget in (
        ("trainer.step_timeout_s", t.step_timeout_s),
        ("trainer.weight_sync_timeout_s", t.weight_sync_timeout_s),
    ):
        if budget is not None and budget < collective:
            warnings.warn(
                f"{key}={budget:g} is below the collective timeout in use "
                f"(workers.collective_timeout_s={collective:g}): a stuck collective will surface as "
                "a step timeout naming the stage, before torch's own watchdog can name the collective",
                ConfigWarning,
                stacklevel=2,
            )


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides (then env overrides); validated."""
    merged = OmegaConf.create({})
    if config_file is not None:
        path = Path(config_file)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config: cannot read {path}: {exc}".splitlines()[0]) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config: {path} must hold a mapping of keys, not {type(data).__name__}"
            )
        merged = OmegaConf.merge(merged, OmegaConf.create(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: override {item!r} is not key=value")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except Exception as exc:  # omegaconf raises many types for bad syntax
            raise ConfigError(
                f"config: cannot parse override {item!r}: {exc}".splitlines()[0]
            ) from None
    values = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(values, dict)
    cfg = _build(values)  # type: ignore[arg-type]
    validate_cfg(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (what config.yaml holds)."""
    return attrs.asdict(
        cfg, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v
    )


def help_text() -> str:
    """Every key with its type, default and doc (``python -m trainer --help``)."""
    lines = []
    defaults = Config()
    for key, a, tp in iter_fields():
        obj: Any = defaults
        for part in key.split("."):
            obj = getattr(obj, part)
        env = a.metadata.get("env")
        env_s = f" [env {env}]" if env else ""
        lines.append(
            f"  {key} = {obj!r}  ({_type_name(tp)}){env_s}\n      {a.metadata.get('doc', '')}"
        )
    return "\n".join(lines)
