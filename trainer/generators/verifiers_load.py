"""A verifiers 0.4 environment from ``generator.kwargs``: the config checked, the environment
and its tasks loaded (:func:`load_environment`), and the verifiers objects an episode needs
(:func:`model_context`).

Imports ``verifiers`` only when called (it is an optional extra: ``pip install -e
'.[verifiers]'``); everything here blocks (imports, reading a taskset), so callers on the
event loop run it in a thread.

verifiers 0.4 imports a taskset or a harness by a **top-level** module name (an installed
package: ``{"id": "my_taskset"}``), and fails on a dotted one (``importlib.util.find_spec``
of ``verifiers.v1.tasksets.<a.b>`` raises). A dotted id (a module of your project, such as
``examples.verifiers_reasoning_gym``) is imported here and handed to verifiers under an alias,
its dots as ``__``: ``examples__verifiers_reasoning_gym``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from trainer.errors import ConfigError

__all__ = ["LoadedEnvironment", "check_spec", "load_environment", "model_context"]

#: The runtime a harness program runs in unless ``generator.kwargs.runtime`` says otherwise:
#: a local subprocess (verifiers' own default is Prime Intellect's remote sandboxes).
DEFAULT_RUNTIME: Mapping[str, object] = {"type": "subprocess"}


@attrs.frozen
class LoadedEnvironment:
    """A verifiers environment (``verifiers.v1.Env``) and its taskset's tasks, in order."""

    env: Any
    tasks: tuple[Any, ...]


def check_spec(name: str, spec: Any, *, required: bool) -> dict[str, object] | None:
    """``generator.kwargs.<name>`` as a dict with a string ``id`` (None when absent and not
    required); ConfigError naming the key otherwise."""
    if spec is None and not required:
        return None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("id"), str) or not spec["id"]:
        raise ConfigError(
            f"config: generator.kwargs.{name} must be a mapping with a module id, as "
            f"generator.kwargs.{name}.id=my_{name} (got {spec!r})"
        )
    return dict(spec)


def _importable_id(ident: str) -> str:
    """``ident`` as verifiers can import it (see the module docstring)."""
    if "." not in ident:
        return ident
    alias = ident.replace(".", "__")
    sys.modules.setdefault(alias, importlib.import_module(ident))
    return alias


def load_environment(
    taskset: Mapping[str, Any],
    harness: Mapping[str, Any] | None,
    runtime: Mapping[str, object] | None,
    max_turns: int,
) -> LoadedEnvironment:
    """The single-agent environment of these configs, its tasks listed (blocking).

    ConfigError when verifiers refuses a config (its pydantic message) or a module does not
    import; ImportError (naming the extra) when verifiers is not installed.
    """
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            f"trainer.generators.verifiers_env needs verifiers 0.4 ({exc}): "
            "pip install -e '.[verifiers]'"
        ) from exc
    os.environ.setdefault(_API_KEY_VAR, "unused")  # read by verifiers' client; the proxy needs none
    agent: dict[str, object] = {"runtime": dict(runtime or DEFAULT_RUNTIME), "max_turns": max_turns}
    try:
        config: dict[str, object] = {"taskset": {**taskset, "id": _importable_id(taskset["id"])}}
        if harness is not None:
            agent["harness"] = {**harness, "id": _importable_id(harness["id"])}
        config["agent"] = agent
        env = vf.load_environment(vf.SingleAgentEnvConfig.model_validate(config))
        tasks = tuple(env.taskset)
    except (ImportError, ValueError, TypeError) as exc:  # pydantic's errors are ValueErrors
        raise ConfigError(
            f"config: generator.kwargs does not make a verifiers environment: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not tasks:
        raise ConfigError(f"config: the verifiers taskset {taskset['id']!r} has no tasks")
    return LoadedEnvironment(env, tasks)


def model_context(
    base_url: str,
    model: str,
    tokenizer_dir: str,
    temperature: float,
    max_tokens: int,
    *,
    seed: int | None = None,
) -> Any:
    """verifiers' ``ModelContext`` of one episode: its training client (client-side rendering
    with the model's own tokenizer, token-in calls) at ``base_url`` (ends in ``/v1``); ``seed``
    goes to the engine with each of the episode's model calls (verifiers passes sampling
    fields it does not know through)."""
    import verifiers.v1 as vf

    return vf.ModelContext(
        model=model,
        # model_validate: the pydantic models' validation from plain fields (their generated
        # __init__ signatures do not show the defaults, or a field passed through like seed)
        client=vf.TrainClientConfig.model_validate(
            {
                "base_url": base_url,
                "api_key_var": _API_KEY_VAR,
                "renderer_model_name": tokenizer_dir,
            }
        ),
        sampling=vf.Sampling.model_validate(
            {
                "temperature": temperature,
                "max_tokens": max_tokens,
                **({} if seed is None else {"seed": seed % 2**63}),
            }
        ),
    )


#: The variable verifiers' client reads its API key from (the proxy needs none; the client
#: needs the variable set).
_API_KEY_VAR = "TRAINER_VERIFIERS_API_KEY"
