"""The task ``reasoning_gym``: reasoning-gym's procedural datasets, scored by their own scorers.

``data.task=reasoning_gym`` makes the training items with
``reasoning_gym.create_dataset(name, size=data.num_examples, seed=trainer.seed, **config)`` (a
weighted mix through reasoning-gym's ``composite`` dataset) and the eval items the same way
with the seeds past training's, leaving out any eval item whose question is also asked in
training or a few-shot turn (a small task space repeats questions across seeds). Each item is
a chat prompt: a system message from ``SYSTEM_PROMPTS`` (``data.reasoning_gym.system_prompt``),
``data.reasoning_gym.few_shot`` solved items as earlier turns (the same for every prompt) and
the question; its answer is the item's ``answer``, and :attr:`~trainer.data.Example.extra` holds
the ``question``, the ``metadata`` and which dataset (and config) made it.

:func:`reasoning_gym_reward` scores a response as reasoning-gym does: ``extract_answer(
response, tag_name=TAG)`` (``data.reasoning_gym.answer_tag``; None takes the whole response),
then the dataset's own ``score_answer(answer, entry)``, partial credit kept (most datasets
pay ``len(answer) / len(found)`` when the answer is inside what was found) unless
``data.reasoning_gym.partial_credit`` is false (then 1.0 for a full score, else 0). It needs only the
example's extra fields, so it runs in a reward worker process as well as in the loop.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.data._examples import Example
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import DataConfig

__all__ = ["DEFAULT_NUM_EVAL", "reasoning_gym_examples", "reasoning_gym_reward"]

log = logging.getLogger(__name__)

#: The key of a drawn entry (:func:`_draw`) that names the dataset which made it.
DATASET = "_dataset"

#: Eval items when ``data.num_eval_examples`` is unset (before training questions are left out).
DEFAULT_NUM_EVAL = 100


def reasoning_gym_examples(data: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """``(train, eval)`` of ``data.reasoning_gym``: ``data.num_examples`` items drawn with
    ``seed``, ``data.num_eval_examples`` with ``seed + data.num_examples``, less those whose
    question training or a few-shot turn asks too (ConfigError when none is left); the
    ``few_shot`` solved items are drawn past the eval items' seeds."""
    rg, num_examples = data.reasoning_gym, data.num_examples
    num_eval = data.num_eval_examples or DEFAULT_NUM_EVAL
    # item i of a dataset is drawn by Random(seed + i): each draw's seeds start past the last's
    shots = _draw(rg, rg.few_shot, seed + num_examples + num_eval)
    prefix = _shot_turns(rg, shots)
    train = [_example(rg, e, i, prefix) for i, e in enumerate(_draw(rg, num_examples, seed))]
    asked = {ex.extra["question"] for ex in train} | {e["question"] for e in shots}
    drawn = _draw(rg, num_eval, seed + num_examples)
    held_out = [
        _example(rg, e, i, prefix) for i, e in enumerate(drawn) if e["question"] not in asked
    ]
    if not held_out:
        raise ConfigError(
            f"config: data.task=reasoning_gym: each of the {len(drawn)} eval items is also asked "
            f"in training ({num_examples} items) or a few-shot turn: the datasets' configs allow "
            "too few questions; widen them (data.reasoning_gym.config) or lower "
            "data.num_examples"
        )
    if 2 * len(held_out) < len(drawn):
        log.warning(
            "data.task=reasoning_gym: %d of the %d eval items are also asked in training (%d "
            "items) or a few-shot turn, so eval measures only %d held-out questions; widen the "
            "datasets' configs (data.reasoning_gym.config), lower data.num_examples or raise "
            "data.num_eval_examples",
            len(drawn) - len(held_out),
            len(drawn),
            num_examples,
            len(held_out),
        )
    return train, held_out


def _draw(rg: Any, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` entries of the datasets ``rg`` (``data.reasoning_gym``) names, drawn by
    ``seed``; each entry's ``DATASET`` key names the dataset that made it."""
    if size == 0:
        return []
    import reasoning_gym  # the optional extra: checked at load (trainer.config)
    from reasoning_gym.composite import DatasetSpec

    specs = rg.datasets()
    if len(specs) == 1:
        name, _weight, config = specs[0]
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    else:
        mix = [DatasetSpec(name, weight, config) for name, weight, config in specs]
        dataset = reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=mix)
    entries = []
    for entry in dataset:
        metadata = entry.get("metadata") or {}
        name = metadata.get("source_dataset", specs[0][0])
        entries.append({**entry, "metadata": metadata, DATASET: name})
    return entries


def _shot_turns(rg: Any, shots: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The few-shot turns: each solved item's question, then its answer as the reply (inside
    ``answer_tag``'s tags when the reward looks for them)."""
    turns = []
    for entry in shots:
        answer = str(entry["answer"])
        if rg.answer_tag is not None:
            answer = f"<{rg.answer_tag}>{answer}</{rg.answer_tag}>"
        turns += [
            {"role": "user", "content": entry["question"]},
            {"role": "assistant", "content": answer},
        ]
    return turns


def _example(rg: Any, entry: dict[str, Any], index: int, prefix: list[dict[str, str]]) -> Example:
    """One item as a chat prompt: the system message, the few-shot turns, the question."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = [] if rg.system_prompt is None else [SYSTEM_PROMPTS[rg.system_prompt]]
    messages = [{"role": "system", "content": s} for s in system] + prefix
    messages.append({"role": "user", "content": entry["question"]})
    name = entry[DATASET]
    configs = {n: config for n, _weight, config in rg.datasets()}
    extra = {
        "question": entry["question"],
        "metadata": entry["metadata"],
        "reasoning_gym": {
            "dataset": name,
            "config": configs[name],
            "answer_tag": rg.answer_tag,
            "partial_credit": rg.partial_credit,
        },
    }
    return Example(tuple(messages), str(entry["answer"]), index, extra=extra)


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json))


def reasoning_gym_reward(response: str, answer: str, *, extra: Mapping[str, Any]) -> float:
    """reasoning-gym's score of ``response`` for the item ``extra`` describes (module doc).

    ValueError when ``extra`` has no ``reasoning_gym`` field (an item the task did not make).
    """
    from reasoning_gym.utils import extract_answer

    info = extra.get("reasoning_gym")
    if not isinstance(info, Mapping):
        raise ValueError(
            "reasoning_gym_reward scores the items of data.task=reasoning_gym; this example's "
            f"extra fields ({sorted(extra)}) have no 'reasoning_gym'"
        )
    tag = info["answer_tag"]
    found = response.strip() if tag is None else extract_answer(response, tag_name=tag)
    dataset = _scorer(info["dataset"], json.dumps(dict(info["config"]), sort_keys=True))
    entry = {"question": extra["question"], "answer": answer, "metadata": extra["metadata"]}
    score = float(dataset.score_answer(found, entry))
    # an item made before the key existed (kept in flight across a resume) was paid partial credit
    return score if info.get("partial_credit", True) else float(score >= 1.0)
