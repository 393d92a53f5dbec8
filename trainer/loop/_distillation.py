"""On-policy distillation (``algorithm.distillation``): the teacher scores the step's sampled
sequences, and each trained token's advantage becomes the negative reverse KL to it.

The teacher is an engine serving the teacher model (``RunContext.teacher``); it scores each
trajectory's ``prompt + response`` with vLLM's prompt logprobs, one request per trajectory,
all at once (the engine batches them), each inside ``operation("teacher_logprobs")`` under
the step's deadline: a hung teacher ends the step with ``StepTimeoutError`` naming stage
``teacher_logprobs`` and that operation. The student's logprob of a token is the one it was
sampled with (the rollout's, as tinker-cookbook's recipe reads the sampler's); the reverse
KL's single-sample estimate at a token is ``student - teacher`` (Thinking Machines, "On-Policy
Distillation", 2025). docs/algorithms.md#on-policy-distillation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import trio

from trainer.generators import Trajectory
from trainer.loop._context import RunContext, Teacher
from trainer.vocabulary import fire_fault, operation
from trainer.workers.batch import TrainBatch

__all__ = ["distill", "distillation_advantages", "teacher_logprobs"]


async def teacher_logprobs(teacher: Teacher, trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """``teacher``'s logprob of every token after the first of each trajectory's ``prompt +
    response``, shifted as :func:`~trainer.loop._stages.make_batch` shifts (position ``t``
    holds token ``t + 1``'s), ``[B, width - 1]``, 0 past a sequence's end."""
    seqs = [t.prompt_ids + t.response_ids for t in trajectories]
    width = max(len(s) for s in seqs)
    out = torch.zeros((len(seqs), width - 1), dtype=torch.float32)

    async def one(i: int) -> None:
        with operation("teacher_logprobs"):
            await fire_fault("teacher_logprobs")
            scores = await teacher.prompt_logprobs(seqs[i])
        values = [s.logprob for s in scores[1:] if s is not None]
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)

    async with trio.open_nursery() as nursery:
        for i in range(len(seqs)):
            nursery.start_soon(one, i)
    return out


def distillation_advantages(
    task_advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    reverse_kl_coef: float,
    reward_weight: float,
) -> tuple[torch.Tensor, float]:
    """Each token's advantage ``[B, T]``: ``reverse_kl_coef * (teacher - student)`` (the
    negative reverse KL's estimate at the sampled token) plus ``reward_weight`` times the
    task's (``[B]``, broadcast over the tokens, or ``[B, T]``), 0 where ``mask`` is 0; and the
    mean reverse KL ``student - teacher`` over the trained tokens (0.0 for none)."""
    trained = mask != 0
    reverse_kl = torch.where(trained, student_logprobs - teacher_logprobs, 0.0)
    task = task_advantages if task_advantages.dim() == 2 else task_advantages[:, None]
    advantages = -reverse_kl_coef * reverse_kl + reward_weight * task.to(reverse_kl.dtype)
    tokens = int(trained.sum())
    mean = float(reverse_kl.sum()) / tokens if tokens else 0.0
    return torch.where(trained, advantages, 0.0), mean


def distill(
    ctx: RunContext, batch: TrainBatch, teacher: torch.Tensor, task_advantages: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The batch's advantages under ``algorithm.distillation`` and ``distill/reverse_kl`` (the
    mean over the trained tokens of student minus teacher logprob)."""
    d = ctx.cfg.algorithm.distillation
    assert batch.rollout_logprobs is not None, "make_batch keeps the rollout's logprobs"
    advantages, reverse_kl = distillation_advantages(
        task_advantages,
        batch.rollout_logprobs,
        teacher,
        batch.loss_mask,
        reverse_kl_coef=d.reverse_kl_coef,
        reward_weight=d.reward_weight,
    )
    return advantages, {"distill/reverse_kl": reverse_kl}
