"""A verifiers 0.4 taskset whose reward the untrained tiny model earns some of: the share of
digits among the characters of its reply (its vocabulary has ten digits in 56 words).
reasoning-gym's scorer gives the tiny model 0.0 on every reply (it never writes
``<answer>...</answer>``), so a run on the example's taskset has no advantage to train on; this
one does, to show a verifiers reward moving the policy."""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["DigitsTaskset"]


class DigitsTaskConfig(vf.TaskConfig):
    pass


class DigitsTask(vf.Task[vf.TaskData, vf.State, DigitsTaskConfig]):
    @vf.reward
    async def digits(self, task: vf.TaskData, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""  # renderers joins the tiny model's words without spaces
        return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0


class DigitsTasksetConfig(vf.TasksetConfig):
    size: int = 4


class DigitsTaskset(vf.Taskset[DigitsTask, DigitsTasksetConfig]):
    def load(self):
        for i in range(self.config.size):
            data = vf.TaskData(id=f"digits-{i}", prompt=f"count {i} and {i + 1} is")
            yield DigitsTask(data, self.config.task)
