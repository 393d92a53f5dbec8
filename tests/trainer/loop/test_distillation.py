"""On-policy distillation's parts: the advantages against hand-worked values, a hung teacher
ending the step typed (stage and operation ``teacher_logprobs``), the config's refusals. A
real run is ``tests/trainer/run/test_distillation_run.py``."""

from __future__ import annotations

import pytest
import torch
import trio

from engines.client import InferenceClient
from trainer.config import load_config
from trainer.errors import ConfigError, StepTimeoutError
from trainer.generators import Trajectory
from trainer.loop._distillation import distillation_advantages, teacher_logprobs
from trainer.vocabulary import Timer, install_faults, step_deadline


def test_the_advantage_is_the_negative_reverse_kl_plus_the_weighted_task_advantage() -> None:
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -4.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    task = torch.tensor([2.0, -1.0])  # one per trajectory, broadcast over its tokens
    adv, kl = distillation_advantages(
        task, student, teacher, mask, reverse_kl_coef=0.5, reward_weight=0.25
    )
    # token by token: 0.5 * (teacher - student) + 0.25 * task, 0 where untrained
    want = torch.tensor(
        [
            [0.5 * -0.5 + 0.5, 0.5 * 1.0 + 0.5, 0.0],
            [0.5 * 0.1 - 0.25, 0.5 * -1.0 - 0.25, 0.5 * -9.0 - 0.25],
        ]
    )
    assert torch.allclose(adv, want)
    # student - teacher over the five trained tokens: 0.5 - 1.0 - 0.1 + 1.0 + 9.0
    assert kl == pytest.approx(9.4 / 5)


def test_without_the_task_and_with_per_token_task_advantages() -> None:
    student = torch.tensor([[-1.0, -2.0]])
    teacher = torch.tensor([[-3.0, -2.0]])
    mask = torch.ones(1, 2)
    adv, kl = distillation_advantages(
        torch.tensor([[5.0, 7.0]]), student, teacher, mask, reverse_kl_coef=1.0, reward_weight=0.0
    )
    assert adv.tolist() == [[-2.0, 0.0]] and kl == pytest.approx(1.0)
    adv, _ = distillation_advantages(
        torch.tensor([[5.0, 7.0]]), student, teacher, mask, reverse_kl_coef=0.0, reward_weight=2.0
    )
    assert adv.tolist() == [[10.0, 14.0]]
    _, kl = distillation_advantages(
        torch.zeros(1), student, teacher, torch.zeros(1, 2), reverse_kl_coef=1.0, reward_weight=0.0
    )
    assert kl == 0.0  # no trained token: no estimate, not NaN


async def test_a_hung_teacher_ends_the_step_naming_its_stage_and_operation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    trajectory = Trajectory(
        prompt_ids=[5, 6],
        response_ids=[7],
        loss_mask=[1],
        reward=0.0,
        rollout_logprobs=[-1.0],
        group_id=0,
    )
    install_faults("teacher_logprobs:hang")
    try:
        async with InferenceClient(["http://127.0.0.1:9"]) as teacher:  # never reached
            with pytest.raises(StepTimeoutError) as info:
                with step_deadline(3, 60.0), Timer("teacher_logprobs", {}):
                    await teacher_logprobs(teacher, [trajectory])
    finally:
        install_faults(None)
    err = info.value
    assert (err.step, err.stage, err.operation) == (3, "teacher_logprobs", "teacher_logprobs")


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["algorithm.distillation.teacher_engine=vllm"], "engine.backend=vllm"),
        (
            ["algorithm.distillation.reverse_kl_coef=0"],
            "leave every advantage 0",
        ),
    ],
)
def test_a_distillation_that_cannot_run_is_refused_at_load(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        load_config(None, ["algorithm.distillation.teacher_path=/some/teacher", *overrides])
    assert "\n" not in str(info.value)
