"""A verifiers 0.4 taskset over reasoning-gym: procedural tasks with reasoning-gym's own scorer,
nothing to download. Train on it with :mod:`trainer.generators.verifiers_env`::

    .venv/bin/python -m trainer generator.cls=trainer.generators.verifiers_env:VerifiersGenerator \\
        generator.kwargs.taskset.id=examples.verifiers_reasoning_gym \\
        generator.kwargs.taskset.dataset=basic_arithmetic \\
        generator.kwargs.harness.id=examples.verifiers_reasoning_gym.harness

Each task is one reasoning-gym item (``reasoning_gym.create_dataset(dataset, size=, seed=,
**dataset_config)``): its question as the prompt, reasoning-gym's default system prompt (the
answer in ``<answer>...</answer>``), and one reward, ``correct``: the dataset's
``score_answer`` of the answer extracted from the model's last reply (partial credit kept).
The harness beside it (:mod:`examples.verifiers_reasoning_gym.harness`) asks the model once,
in this process.
"""

from __future__ import annotations

from typing import Any

import reasoning_gym
import verifiers.v1 as vf
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

__all__ = ["ReasoningGymTaskset"]


class ReasoningGymTaskConfig(vf.TaskConfig):
    pass


class ReasoningGymData(vf.TaskData):
    #: The reasoning-gym dataset and its config, to score with its own scorer.
    dataset: str
    dataset_config: dict[str, Any] = {}
    #: The item as reasoning-gym scores it: question, answer, metadata.
    entry: dict[str, Any]


class ReasoningGymTask(vf.Task[ReasoningGymData, vf.State, ReasoningGymTaskConfig]):
    @vf.reward
    async def correct(self, task: ReasoningGymData, trace: vf.Trace) -> float:
        """reasoning-gym's score of the ``<answer>`` of the last reply (0.0 without one)."""
        scorer = reasoning_gym.create_dataset(task.dataset, size=1, seed=0, **task.dataset_config)
        return float(scorer.score_answer(extract_answer(trace.last_reply or ""), task.entry))


class ReasoningGymTasksetConfig(vf.TasksetConfig):
    #: Any reasoning-gym dataset name, and its config fields.
    dataset: str = "basic_arithmetic"
    dataset_config: dict[str, Any] = {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
    }
    #: How many items, from which seed (another seed: other items, for held-out ones).
    size: int = 64
    seed: int = 0


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, ReasoningGymTasksetConfig]):
    def load(self):
        c = self.config
        items = reasoning_gym.create_dataset(
            c.dataset, size=c.size, seed=c.seed, **c.dataset_config
        )
        for i, item in enumerate(items):
            entry = {k: item[k] for k in ("question", "answer", "metadata")}
            data = ReasoningGymData(
                id=f"{c.dataset}-{c.seed}-{i}",
                prompt=item["question"],
                system_prompt=SYSTEM_PROMPTS["default"],
                dataset=c.dataset,
                dataset_config=c.dataset_config,
                entry=entry,
            )
            yield ReasoningGymTask(data, c.task)
