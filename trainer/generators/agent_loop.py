"""The default generator: one agent loop per trajectory, all of them in one nursery.

Each trajectory alternates model turns (``engine.generate``, operation ``generate``) and environment steps
(``operation("env_step")``) until the environment says it is done, ``max_turns`` is reached
or the response budget runs out. The default environment is single-turn: it scores the
first response with the reward function. Override :meth:`AgentLoopGenerator.env_step` for
multi-turn environments (tools, games, HTTP environments).
"""

from __future__ import annotations

import statistics

import attrs

from trainer.generators.base import (
    Generator,
    GeneratorInput,
    GeneratorOutput,
    Trajectory,
    TrajectoryInput,
)
from trainer.vocabulary import fire_fault, open_owner_nursery, operation

__all__ = ["AgentLoopGenerator", "EnvStep"]


@attrs.frozen
class EnvStep:
    """What the environment answers after a model turn."""

    #: True ends the trajectory; ``reward`` is then its reward.
    done: bool
    reward: float = 0.0
    #: Text appended to the conversation for the next model turn (loss-masked).
    observation: str = ""


class AgentLoopGenerator(Generator):
    """Rolls out each trajectory as its own task; see the module docstring."""

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        results: list[Trajectory | None] = [None] * len(batch)

        async def run_one(i: int, item: TrajectoryInput) -> None:
            results[i] = await self.rollout(item)

        async with open_owner_nursery() as nursery:
            for i, item in enumerate(batch):
                nursery.start_soon(run_one, i, item)
        trajectories = [t for t in results if t is not None]
        assert len(trajectories) == len(batch)
        return GeneratorOutput(
            trajectories,
            metrics={
                "generate/num_turns_mean": statistics.fmean(t.num_turns for t in trajectories),
                "generate/truncated_frac": statistics.fmean(
                    t.finish_reason in ("length", "truncated") for t in trajectories
                ),
            },
        )

    async def rollout(self, item: TrajectoryInput) -> Trajectory:
        """One trajectory: model turn, environment step, repeat until done."""
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        finish = "stop"
        reward = 0.0
        turns = 0
        for turn in range(self.max_turns):
            budget = self.max_response_tokens - len(response)
            if budget <= 0:
                finish = "truncated"
                break
            sampling = attrs.evolve(
                self.sampling,
                seed=item.seed + turn,
                max_tokens=min(self.sampling.max_tokens, budget),
            )
            # the engine client names the operation and fires its fault (where it runs)
            completion = await self.engine.generate(
                item.prompt_ids + response, sampling, trajectory_id=item.trajectory_id
            )
            turns += 1
            response += completion.token_ids
            mask += [1] * len(completion.token_ids)
            logprobs += completion.logprobs
            finish = completion.finish_reason
            with operation("env_step"):
                await fire_fault("env_step")
                step = await self.env_step(item, response, turn)
            if step.done:
                reward = step.reward
                break
            left = self.max_response_tokens - len(response)  # what this turn's tokens left
            obs = self.tokenizer.encode(step.observation, add_special_tokens=False)[:left]
            response += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
        text = self.tokenizer.decode(
            [t for t, m in zip(response, mask) if m], skip_special_tokens=True
        )
        return Trajectory(
            prompt_ids=item.prompt_ids,
            response_ids=response,
            loss_mask=mask,
            reward=reward,
            rollout_logprobs=logprobs,
            group_id=item.group_id,
            finish_reason=finish,
            num_turns=turns,
            response_text=text,
        )

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        """Single-turn default: score the response with the reward function and stop."""
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        return EnvStep(done=True, reward=float(self.reward_fn(text, item.answer)))
