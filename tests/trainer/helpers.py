"""Generator-side helpers shared by the trainer tests: a batch of prompts, a custom generator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import httpx
import torch

from trainer.generators import (
    AgentLoopGenerator,
    Generator,
    GeneratorInput,
    GeneratorOutput,
    Trajectory,
    TrajectoryInput,
)
from trainer.workers.batch import TrainBatch

__all__ = [
    "EngineVersions",
    "OneCallGenerator",
    "Recording",
    "batch_of",
    "varied_reward",
    "weighted",
]


def batch_of(tokenizer, n: int) -> GeneratorInput:
    prompt = "max 7 5 ="
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return GeneratorInput(
        tuple(
            TrajectoryInput(
                prompt=prompt,
                prompt_ids=ids,
                answer="7",
                group_id=0,
                trajectory_id=f"1-0-{i}",
                seed=i,
            )
            for i in range(n)
        )
    )


class OneCallGenerator(Generator):
    """A custom generator: one model call per trajectory, no agent loop, no environment."""

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        out = []
        for item in batch:
            c = await self.engine.generate(item.prompt_ids, self.sampling, trajectory_id=None)
            out.append(
                Trajectory(
                    prompt_ids=item.prompt_ids,
                    response_ids=c.token_ids,
                    loss_mask=[1] * len(c.token_ids),
                    reward=0.0,
                    rollout_logprobs=c.logprobs,
                    group_id=item.group_id,
                    finish_reason=c.finish_reason,
                )
            )
        return GeneratorOutput(out)


class EngineVersions(OneCallGenerator):
    """:class:`OneCallGenerator` that notes, at each step's generation, the trainer's weight
    version (``batch.weight_version``) and the one its reference server reports
    (``GET /engine_stats``), in :attr:`seen` (HTTP engines only)."""

    #: ``(trainer's version, engine's version)`` per generation, in order, every run's.
    seen: ClassVar[list[tuple[int, int]]] = []

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        (url,) = self.engine.urls
        async with httpx.AsyncClient(timeout=60, headers=self.engine.headers) as http:
            response = await http.get(f"{url}/engine_stats")
            response.raise_for_status()
            served = response.json()["weight_version"]
        self.seen.append((batch.weight_version, served))
        return await super().generate(batch)


def varied_reward(response: str, answer: str) -> float:
    """A reward in [0, 1] that differs between responses, so that every step has a loss.

    The built-in task's reward is 0 for nearly every response of the untrained tiny model,
    which makes advantages, losses and gradients 0: a comparison of such runs proves little.
    """
    return (sum(map(ord, response)) % 7) / 6


class Recording(AgentLoopGenerator):
    """The built-in loop, recording its kwargs and every item it was given (per process)."""

    seen: list = []
    options: list = []

    def __init__(self, *, label: str = "", depth: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        Recording.options.append((label, depth))

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        Recording.seen.extend(batch)
        return await super().generate(batch)


def weighted(response: str, answer: str, *, extra) -> float:
    """A reward that is the row's ``weight`` field: proves the extra reached it."""
    return float(extra["weight"])


def random_batch(model_dir: Path, rows: int, *, seed: int, width: int = 10) -> TrainBatch:
    """A training batch of random tokens over the model's vocabulary (responses from token 3)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width - 1)
    mask[:, 3:] = 1.0
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (rows, width), generator=g),
        attention_mask=torch.ones(rows, width, dtype=torch.long),
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g),
        old_logprobs=-3.0 + 0.1 * torch.randn(rows, width - 1, generator=g),
    )


def assert_same_adam_step(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, lr: float
) -> None:
    """The weights after one AdamW step taken two ways (sharded and not) are the same step.

    AdamW's first step moves each element by about ``lr * g / (|g| + eps)``. Where a gradient
    is within rounding of ``eps`` (``|g|`` ~ 1e-8: seen on a handful of the 100k elements),
    the two ways' summation orders move that element's update by a visible fraction of
    ``lr``; everywhere else the updates agree to float precision. So: every element within
    5% of ``lr``, and all but one in a thousand within ``1e-5``.
    """
    assert set(got) == set(expected)
    close, total = 0, 0
    for name, w in expected.items():
        torch.testing.assert_close(got[name], w, rtol=0.0, atol=0.05 * lr, msg=name)
        close += int(torch.isclose(got[name], w, rtol=1e-4, atol=1e-5).sum())
        total += w.numel()
    assert total - close <= total // 1000, f"{total - close} of {total} elements differ"


def half_informative_reward(response: str, answer: str) -> float:
    """0 for every response to a prompt whose answer is even (a group that teaches nothing),
    :func:`varied_reward` for the others: dynamic sampling must filter the first kind."""
    return 0.0 if int(answer) % 2 == 0 else varied_reward(response, answer)
