"""Every typed error the trainer raises, all picklable.

Each error passes every field to ``super().__init__`` so that ``pickle`` (Ray, multiprocessing)
rebuilds it with the same fields; the message is computed from the fields in ``__str__``.

Every one derives from ``TrainerError`` (the root: ``except TrainerError`` catches every error
of ours and nothing else) and keeps the builtin base it always had (in brackets), so ``except
RuntimeError`` and ``except ValueError`` catch what they did.

Hierarchy::

    Exception
    └── TrainerError                           the root
        ├── StepTimeoutError                   (RuntimeError) a step's budget (trainer.step_timeout_s) ran out
        │   └── WeightSyncTimeoutError         a weight sync's budget (trainer.weight_sync_timeout_s) ran out
        ├── RolloutTimeoutError                (RuntimeError) a fully-async rollout ran past generator.rollout_timeout_s, attempt after attempt
        ├── InferenceServerError               (RuntimeError) an engine answered non-2xx or a malformed body
        │   └── InferenceServerTimeoutError    a control-plane request outlived its timeout
        ├── EngineStartError                   (RuntimeError) an engine server died or never became healthy
        ├── ForkServerError                    (RuntimeError) engine.fork_server could not be reached or refused
        ├── EngineFailedError                  (RuntimeError) an engine failed again past engine.max_restarts
        ├── EngineUnusableError                (RuntimeError) a weight transfer broke off and no complete one followed
        ├── WeightSyncMismatchError            (RuntimeError) after a sync an engine scores a probe unlike the policy
        ├── CheckpointEngineInitError          (RuntimeError) weight-sync process-group init did not finish in time
        ├── CheckpointError                    (RuntimeError) a checkpoint is missing, incomplete or corrupted
        ├── WorkerError                        (RuntimeError) a policy/ref worker failed or died
        ├── RayClusterStartError               (RuntimeError) ``ray.init`` failed on every attempt
        ├── FaultInjected                      (RuntimeError) an ``error=`` fault from ``faults=`` fired
        ├── RewardError                        (RuntimeError) more reward calls failed in a step than data.max_reward_failures
        ├── ConfigError                        (ValueError) bad configuration, found at load time
        └── DataError                          (ValueError) a bad row in a data file

``StepTimeoutError`` is deliberately not a ``TimeoutError``: retry paths that catch
``TimeoutError`` (transport retries, library code) must not swallow a step's deadline.
``RolloutTimeoutError`` is not one either, for the same reason.
"""

from __future__ import annotations

__all__ = [
    "CheckpointEngineInitError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EngineFailedError",
    "EngineStartError",
    "EngineUnusableError",
    "FaultInjected",
    "ForkServerError",
    "InferenceServerError",
    "InferenceServerTimeoutError",
    "RayClusterStartError",
    "RewardError",
    "RolloutTimeoutError",
    "StepTimeoutError",
    "TrainerError",
    "WeightSyncMismatchError",
    "WeightSyncTimeoutError",
    "WorkerError",
]


class TrainerError(Exception):
    """The root of every typed error the trainer raises (the role of httpx's ``HTTPError``)."""


def _fmt_seconds(value: float) -> str:
    return f"{value:g}"


class StepTimeoutError(TrainerError, RuntimeError):
    """A step (generation through weight sync) ran past ``trainer.step_timeout_s``.

    ``stage`` and ``operation`` name where the step was waiting when its budget ran out;
    ``operation`` is ``'await'`` when no named operation was open. ``detail``, when set,
    says what the run did about it (e.g. a transfer abandoned, engines left paused).
    """

    def __init__(
        self,
        step: int,
        budget_s: float,
        elapsed_s: float,
        stage: str | None,
        operation: str | None,
        detail: str | None = None,
    ) -> None:
        super().__init__(step, budget_s, elapsed_s, stage, operation, detail)
        self.step = step
        self.budget_s = budget_s
        self.elapsed_s = elapsed_s
        self.stage = stage
        self.operation = operation
        self.detail = detail

    def __str__(self) -> str:
        message = (
            f"step {self.step} exceeded its {_fmt_seconds(self.budget_s)}s budget after "
            f"{self.elapsed_s:.1f}s (stage={self.stage!r}, operation={self.operation!r})"
        )
        return message if self.detail is None else f"{message}: {self.detail}"


class WeightSyncTimeoutError(StepTimeoutError):
    """A weight sync ran past ``trainer.weight_sync_timeout_s`` (its own, shorter budget)."""


class RolloutTimeoutError(TrainerError, RuntimeError):
    """One prompt's fully-async rollout ran past ``generator.rollout_timeout_s`` on every attempt.

    A rollout past its bound is cancelled and its prompt handed out again; this ends the run
    when the same prompt's rollout has done so ``attempts`` times in a row (every rollout
    hanging, or one prompt that always does). ``step`` is the step the last attempt was for,
    ``prompt`` its ``(epoch, position)`` in the data order, ``stage`` and ``operation`` where
    that attempt was waiting when it was cut off.
    """

    def __init__(
        self,
        step: int,
        prompt: tuple[int, int],
        attempts: int,
        timeout_s: float,
        stage: str | None,
        operation: str | None,
    ) -> None:
        super().__init__(step, prompt, attempts, timeout_s, stage, operation)
        self.step = step
        self.prompt = prompt
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.stage = stage
        self.operation = operation

    def __str__(self) -> str:
        epoch, position = self.prompt
        return (
            f"the rollout of prompt (epoch {epoch}, position {position}) for step {self.step} "
            f"ran past its {_fmt_seconds(self.timeout_s)}s bound {self.attempts} times in a row "
            f"(stage={self.stage!r}, operation={self.operation!r}); if rollouts are slow but "
            "healthy, raise generator.rollout_timeout_s (unset, it is trainer.step_timeout_s)"
        )


class InferenceServerError(TrainerError, RuntimeError):
    """An inference server answered with a non-2xx status or a body we could not read."""

    def __init__(self, url: str, endpoint: str, status: int | None, detail: str) -> None:
        super().__init__(url, endpoint, status, detail)
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.detail = detail

    def __str__(self) -> str:
        status = "no status" if self.status is None else f"status {self.status}"
        return f"{self.endpoint} on {self.url} failed ({status}): {self.detail}"


class InferenceServerTimeoutError(InferenceServerError):
    """A control-plane request outlived ``engine.control_plane_timeout_s``."""

    def __init__(self, url: str, endpoint: str, timeout_s: float) -> None:
        RuntimeError.__init__(self, url, endpoint, timeout_s)
        self.url = url
        self.endpoint = endpoint
        self.status = None
        self.timeout_s = timeout_s
        self.detail = f"no answer within {_fmt_seconds(timeout_s)}s"

    def __str__(self) -> str:
        return (
            f"{self.endpoint} on {self.url} did not answer within "
            f"{_fmt_seconds(self.timeout_s)}s (engine.control_plane_timeout_s, env "
            f"TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S)"
        )


class EngineStartError(TrainerError, RuntimeError):
    """An engine server the trainer started died or did not become healthy in time."""

    def __init__(self, url: str, reason: str, log_tail: str = "") -> None:
        super().__init__(url, reason, log_tail)
        self.url = url
        self.reason = reason
        self.log_tail = log_tail

    def __str__(self) -> str:
        tail = f"\n--- server log (tail) ---\n{self.log_tail}" if self.log_tail else ""
        return f"engine server {self.url}: {self.reason}{tail}"


class ForkServerError(TrainerError, RuntimeError):
    """A fork server (``engine.fork_server``) could not be reached or refused to start a server."""

    def __init__(self, socket_path: str, reason: str) -> None:
        super().__init__(socket_path, reason)
        self.socket_path = socket_path
        self.reason = reason

    def __str__(self) -> str:
        return f"fork server {self.socket_path}: {self.reason}"


class EngineFailedError(TrainerError, RuntimeError):
    """An engine failed (died, hung, answered 5xx) with its restarts spent.

    ``index`` and ``url``: the engine; ``restarts``: how often it was restarted in this run
    (``engine.max_restarts`` allowed); ``cause``: what its last failure was;
    ``log_tail``: the end of its server's log, where the trainer has it.
    """

    def __init__(
        self, index: int, url: str, restarts: int, max_restarts: int, cause: str, log_tail: str = ""
    ) -> None:
        super().__init__(index, url, restarts, max_restarts, cause, log_tail)
        self.index = index
        self.url = url
        self.restarts = restarts
        self.max_restarts = max_restarts
        self.cause = cause
        self.log_tail = log_tail

    def __str__(self) -> str:
        tail = f"\n--- server log (tail) ---\n{self.log_tail}" if self.log_tail else ""
        return (
            f"engine {self.index} ({self.url}) failed after {self.restarts} restart(s), "
            f"engine.max_restarts={self.max_restarts}: {self.cause}{tail}"
        )


class EngineUnusableError(TrainerError, RuntimeError):
    """A weight transfer into the engines broke off and no complete one followed.

    Real vLLM loads a transfer layer by layer and is broken (its next generation crashes its
    worker) until one complete start / update / finish has succeeded, so the trainer left
    these engines paused rather than resume them. ``urls``: the engines; ``reason``: why the
    re-send could not complete; ``log_tail``: the end of their logs, where the trainer has them.
    """

    def __init__(self, urls: list[str], reason: str, log_tail: str = "") -> None:
        super().__init__(urls, reason, log_tail)
        self.urls = urls
        self.reason = reason
        self.log_tail = log_tail

    def __str__(self) -> str:
        tail = f"\n--- engine log (tail) ---\n{self.log_tail}" if self.log_tail else ""
        return (
            f"engine {', '.join(self.urls)} left paused and unusable: a weight transfer broke "
            f"off and {self.reason}; it must not serve until a complete weight sync succeeds "
            f"(a resumed run sends one first){tail}"
        )


class WeightSyncMismatchError(TrainerError, RuntimeError):
    """After a weight sync, engine ``url`` scores the probe's token at ``position`` (``token``)
    ``engine_logprob``, the policy ``policy_logprob``: further apart than ``tolerance``
    (``sync.verify_tolerance``), so the engine does not serve the policy's weights."""

    def __init__(
        self,
        url: str,
        position: int,
        token: int,
        engine_logprob: float,
        policy_logprob: float,
        tolerance: float,
        weight_version: int,
    ) -> None:
        super().__init__(
            url, position, token, engine_logprob, policy_logprob, tolerance, weight_version
        )
        self.url = url
        self.position = position
        self.token = token
        self.engine_logprob = engine_logprob
        self.policy_logprob = policy_logprob
        self.tolerance = tolerance
        self.weight_version = weight_version

    def __str__(self) -> str:
        diff = abs(self.engine_logprob - self.policy_logprob)
        return (
            f"weight sync {self.weight_version} into {self.url} does not match the policy: at "
            f"probe position {self.position} (token {self.token}) the engine's logprob is "
            f"{self.engine_logprob:.6f}, the policy's {self.policy_logprob:.6f} (apart by "
            f"{diff:.2e}, sync.verify_tolerance {self.tolerance:g}); a weight the engine did not "
            "take (a stale LM head, a name it maps differently) looks so"
        )


class CheckpointEngineInitError(TrainerError, RuntimeError):
    """The weight-sync process group did not initialise within ``sync.group_init_timeout_s``."""

    def __init__(self, group: str, timeout_s: float) -> None:
        super().__init__(group, timeout_s)
        self.group = group
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return (
            f"process group {self.group!r} did not initialise within "
            f"{_fmt_seconds(self.timeout_s)}s; if the init is slow but healthy, raise "
            f"sync.group_init_timeout_s (env TRAINER_GROUP_INIT_TIMEOUT_S)"
        )


class CheckpointError(TrainerError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, or holds something we refuse to load.

    The message names the path, what was wrong and what to do.
    """


class WorkerError(TrainerError, RuntimeError):
    """A worker (policy, ref, critic) failed or died; names the worker, rank and stage."""

    def __init__(self, worker: str, rank: int, stage: str | None, detail: str) -> None:
        super().__init__(worker, rank, stage, detail)
        self.worker = worker
        self.rank = rank
        self.stage = stage
        self.detail = detail

    def __str__(self) -> str:
        return (
            f"worker {self.worker} (rank {self.rank}) failed in stage={self.stage!r}: {self.detail}"
        )


class RayClusterStartError(TrainerError, RuntimeError):
    """``ray.init`` failed on every attempt; carries each attempt's reason."""

    def __init__(self, address: str | None, attempts: int, reasons: list[str]) -> None:
        super().__init__(address, attempts, reasons)
        self.address = address
        self.attempts = attempts
        self.reasons = reasons

    def __str__(self) -> str:
        where = "a local Ray cluster" if self.address is None else f"Ray at {self.address!r}"
        tries = "; ".join(f"attempt {i + 1}: {r}" for i, r in enumerate(self.reasons))
        return (
            f"could not start {where} after {self.attempts} attempt(s) ({tries}); "
            "see /tmp/ray/session_latest/logs/raylet.out and docs/scaling.md"
        )


class FaultInjected(TrainerError, RuntimeError):
    """Raised where an ``OP:error=MSG`` fault fires (see ``faults=``)."""

    def __init__(self, operation: str, message: str, step: int | None = None) -> None:
        super().__init__(operation, message, step)
        self.operation = operation
        self.message = message
        self.step = step

    def __str__(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        return f"fault injected in {self.operation!r}{where}: {self.message}"


class RewardError(TrainerError, RuntimeError):
    """More reward calls failed in one batch of rollouts than ``data.max_reward_failures``.

    A reward call fails when it raises, or runs past ``data.reward_timeout_s`` (a worker
    process is then killed; an ``async`` reward cancelled); each failure scores
    ``data.reward_on_failure`` until there are more than the limit. ``reward_fn`` names the
    function (``module:function`` or a built-in name), ``failures`` how many failed, ``limit``
    the limit, ``response`` and ``answer`` one failing sample (the response cut to 200
    characters), ``reason`` why that one failed.
    """

    def __init__(
        self, reward_fn: str, failures: int, limit: int, response: str, answer: str, reason: str
    ) -> None:
        super().__init__(reward_fn, failures, limit, response, answer, reason)
        self.reward_fn = reward_fn
        self.failures = failures
        self.limit = limit
        self.response = response
        self.answer = answer
        self.reason = reason

    def __str__(self) -> str:
        return (
            f"reward function {self.reward_fn!r} failed {self.failures} times in one batch of "
            f"rollouts, more than data.max_reward_failures={self.limit}; one failing sample: "
            f"response {self.response!r}, answer {self.answer!r}: {self.reason}"
        )


class ConfigError(TrainerError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


class DataError(TrainerError, ValueError):
    """A data file has a bad row; the message names the file and line."""
