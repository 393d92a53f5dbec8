"""The ``data.reasoning_gym`` section (``data.task=reasoning_gym``) and its checks at load.

reasoning-gym (PyPI ``reasoning-gym``, the ``envs`` extra) is imported only when the task is
chosen: a dataset name it does not know, a config field its dataset does not take or a value
its own ``validate()`` refuses is a ``ConfigError`` at load, naming the key (and close names).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import attrs

from trainer.config._fields import config_field as _field
from trainer.errors import ConfigError

__all__ = ["MIX_KEYS", "ReasoningGymConfig", "check_reasoning_gym"]

#: The keys of one entry of ``data.reasoning_gym.mix`` (``config`` may be left out).
MIX_KEYS = ("name", "weight", "config")

_INSTALL = "install it with `bash setup.sh --envs` (pip install -e '.[envs]')"


@attrs.define
class ReasoningGymConfig:
    name: str | None = _field(
        None,
        "data.task=reasoning_gym: one reasoning-gym dataset (e.g. 'chain_sum'); set this or "
        "data.reasoning_gym.mix.",
    )
    config: dict[str, Any] = _field(
        attrs.Factory(dict),
        "The dataset's own config fields, passed to reasoning_gym.create_dataset(name, size=, "
        "seed=, **config) (data.reasoning_gym.config.max_terms=2, or a mapping in YAML).",
    )
    mix: tuple[dict[str, Any], ...] = _field(
        (),
        "A weighted mix of datasets instead of one: a list of {name, weight, config} "
        "(reasoning-gym's composite dataset draws each item's dataset by weight).",
    )
    system_prompt: str | None = _field(
        "default",
        "A system message from reasoning_gym.utils.SYSTEM_PROMPTS by name ('default' asks for "
        "<answer>...</answer>); None: the question is the only message.",
    )
    answer_tag: str | None = _field(
        "answer",
        "The reward scores what extract_answer(response, tag_name=TAG) finds (no tag: 0); "
        "None: the whole response, stripped (for models that cannot write the tags).",
    )
    partial_credit: bool = _field(
        True,
        "Pay the scorer's partial credit (most datasets pay len(answer)/len(reply) to a reply "
        "that contains the answer); false: 1.0 for a reply the scorer pays in full, else 0 "
        "(a policy can learn to list candidates for partial credit: docs/environments.md).",
    )
    few_shot: int = _field(
        0,
        "Solved items shown before each question as earlier chat turns (the question, then "
        "the answer as the reply, in answer_tag's tags when set): the same ones for every "
        "prompt, drawn past the eval items' seeds; eval leaves out their questions. Shows a "
        "small model the reply's format (docs/environments.md).",
    )

    def datasets(self) -> list[tuple[str, float, dict[str, Any]]]:
        """``(name, weight, config)`` of each dataset the section names (one, or the mix)."""
        if self.name is not None:
            return [(self.name, 1.0, dict(self.config))]
        return [(m["name"], float(m["weight"]), dict(m.get("config") or {})) for m in self.mix]


def _check_shape(rg: ReasoningGymConfig) -> None:
    if (rg.name is None) == (not rg.mix):
        raise ConfigError(
            "config: data.task=reasoning_gym needs exactly one of data.reasoning_gym.name (one "
            "dataset) and data.reasoning_gym.mix (a list of {name, weight, config})"
        )
    if rg.mix and rg.config:
        raise ConfigError(
            "config: data.reasoning_gym.config applies to data.reasoning_gym.name; with a mix "
            "give each entry its own config ({name, weight, config})"
        )
    for i, entry in enumerate(rg.mix):
        where = f"config: data.reasoning_gym.mix[{i}]"
        if extra := set(entry) - set(MIX_KEYS):
            raise ConfigError(f"{where} has unknown keys {sorted(extra)}: use {list(MIX_KEYS)}")
        if not isinstance(entry.get("name"), str):
            raise ConfigError(f"{where} needs a dataset 'name', got {entry.get('name')!r}")
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{where}: 'weight' must be a number > 0, got {weight!r}")
        if not isinstance(entry.get("config") or {}, Mapping):
            raise ConfigError(f"{where}: 'config' must be a mapping of the dataset's fields")
    names = [m["name"] for m in rg.mix]
    if len(names) != len(set(names)):
        raise ConfigError(f"config: data.reasoning_gym.mix names a dataset twice: {names}")


def check_reasoning_gym(rg: ReasoningGymConfig, task: str) -> None:
    """ConfigError unless the section describes datasets reasoning-gym can make.

    Each dataset is made once with ``size=1``, so a field its config class does not take or a
    value its ``validate()`` refuses fails here with the dataset's name. With another
    ``data.task`` the section must be left unset.
    """
    if task != "reasoning_gym":
        if rg.name is not None or rg.mix:
            raise ConfigError(
                f"config: data.reasoning_gym applies to data.task=reasoning_gym (the task is "
                f"{task!r}): set data.task=reasoning_gym, or unset data.reasoning_gym"
            )
        return
    _check_shape(rg)
    if rg.few_shot < 0:
        raise ConfigError(
            f"config: data.reasoning_gym.few_shot={rg.few_shot} must be 0 (no solved items "
            "before the question) or more"
        )
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError:
        raise ConfigError(
            f"config: data.task=reasoning_gym needs the reasoning-gym package: {_INSTALL}"
        ) from None
    if rg.system_prompt is not None and rg.system_prompt not in SYSTEM_PROMPTS:
        raise ConfigError(
            f"config: data.reasoning_gym.system_prompt={rg.system_prompt!r} is not one of "
            f"reasoning-gym's SYSTEM_PROMPTS: choose one of {sorted(SYSTEM_PROMPTS)}, or None"
        )
    for name, _weight, config in rg.datasets():
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(name, [n for n in DATASETS if n != "composite"])
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ConfigError(
                f"config: reasoning-gym has no dataset {name!r}{hint}; its {len(DATASETS) - 1} "
                "datasets are listed by `python -c 'import reasoning_gym.factory as f; "
                "print(sorted(f.DATASETS))'`"
            )
        if clash := {"size", "seed"} & set(config):
            raise ConfigError(
                f"config: reasoning-gym dataset {name!r}: {sorted(clash)} are set by the trainer "
                "(data.num_examples, data.num_eval_examples, trainer.seed); remove them"
            )
        try:
            reasoning_gym.create_dataset(name, size=1, seed=0, **config)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ConfigError(
                f"config: reasoning-gym dataset {name!r} refuses its config {config}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
