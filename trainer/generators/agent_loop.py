"""The default generator: one agent loop per trajectory, all of them in one nursery.

Each trajectory alternates model turns (``engine.generate``, operation ``generate``) and environment steps
(``operation("env_step")``) until the environment says it is done, ``max_turns`` is reached
or the response budget runs out. It is token-in, token-out: each model turn is sampled from
``prompt_ids + response_ids`` so far, and an observation is appended as tokens
(:meth:`AgentLoopGenerator.observation_tokens`), so the model's own tokens are never
re-tokenized. The default environment is single-turn: it scores the
first response with the reward function. Override :meth:`AgentLoopGenerator.env_step` for
multi-turn environments (tools, games, HTTP environments).

The first turn of a group is one engine request: the trajectories of one prompt share their
first prompt, and their seeds follow each other, so ``engine.generate_n`` (vLLM's ``n``,
sample ``i`` seeded ``seed + i``) samples exactly what one request per trajectory would, for
one request's overhead and one shared prefill. Later turns are one request per trajectory.
"""

from __future__ import annotations

import statistics

import attrs

from engines.types import Completion, SamplingParams
from trainer.generators.base import (
    Generator,
    GeneratorInput,
    GeneratorOutput,
    Trajectory,
    TrajectoryInput,
)
from trainer.vocabulary import fire_fault, open_owner_nursery, operation

__all__ = ["AgentLoopGenerator", "EnvStep", "shared_first_turns"]


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

        async def run_group(indices: list[int]) -> None:
            first = batch[indices[0]]
            completions = await self.engine.generate_n(
                first.prompt_ids,
                self.turn_sampling(first, 0, self.max_response_tokens),
                len(indices),
                trajectory_id=first.trajectory_id,
            )
            async with open_owner_nursery() as nursery:
                for i, completion in zip(indices, completions):
                    nursery.start_soon(run_one, i, completion)

        async def run_one(i: int, first_turn: Completion | None) -> None:
            results[i] = await self.rollout(batch[i], first_turn)

        async with open_owner_nursery() as nursery:
            for indices in shared_first_turns(batch):
                if len(indices) > 1:
                    nursery.start_soon(run_group, indices)
                else:
                    nursery.start_soon(run_one, indices[0], None)
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

    def turn_sampling(self, item: TrajectoryInput, turn: int, budget: int) -> SamplingParams:
        """Sampling of a model turn: seed ``item.seed + turn``, at most ``budget`` tokens."""
        return attrs.evolve(
            self.sampling, seed=item.seed + turn, max_tokens=min(self.sampling.max_tokens, budget)
        )

    async def rollout(
        self, item: TrajectoryInput, first_turn: Completion | None = None
    ) -> Trajectory:
        """One trajectory: model turn, environment step, repeat until done.

        ``first_turn``, when given, is the completion of turn 0 already sampled (with
        :meth:`turn_sampling` of turn 0) as part of its group's request.
        """
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []  # per token, where the engine labels them (fully-async)
        finish = "stop"
        reward = 0.0
        turns = 0
        for turn in range(self.max_turns):
            budget = self.max_response_tokens - len(response)
            if budget <= 0:
                finish = "truncated"
                break
            if turn == 0 and first_turn is not None:
                completion = first_turn  # sampled with its group (see shared_first_turns)
            else:
                # the engine client names the operation and fires its fault (where it runs)
                completion = await self.engine.generate(
                    item.prompt_ids + response,
                    self.turn_sampling(item, turn, budget),
                    trajectory_id=item.trajectory_id,
                )
            turns += 1
            response += completion.token_ids
            mask += [1] * len(completion.token_ids)
            logprobs += completion.logprobs
            versions += completion.weight_versions or [-1] * len(completion.token_ids)
            finish = completion.finish_reason
            with operation("env_step"):
                await fire_fault("env_step")
                step = await self.env_step(item, response, turn)
            if step.done:
                reward = step.reward
                break
            left = self.max_response_tokens - len(response)  # what this turn's tokens left
            # appended as tokens: the conversation so far is never tokenized again
            obs = self.observation_tokens(item, step.observation)[:left]
            response += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
            versions += [-1] * len(obs)
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
            weight_versions=versions if any(v >= 0 for v in versions) else [],
        )

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        """Single-turn default: score the response with the reward function and stop.

        The reward function gets the example's extra fields when it takes them
        (``extra=item.extra``; see :func:`trainer.data.reward_function`).
        """
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        return EnvStep(done=True, reward=float(self.reward_fn(text, item.answer, extra=item.extra)))

    def observation_tokens(self, item: TrajectoryInput, observation: str) -> list[int]:
        """The tokens an observation appends: a user chat turn for a chat prompt, else its text.

        A chat prompt's observation is rendered on its own as a ``user`` turn followed by the
        generation prompt (:meth:`observation_ids`); a text prompt's is its tokenization
        without special tokens. Override it for another role (``self.observation_ids(
        observation, role="tool")``) or tokens of your own.
        """
        if item.messages is not None:
            return self.observation_ids(observation)
        return self.tokenizer.encode(observation, add_special_tokens=False)


def shared_first_turns(batch: GeneratorInput) -> list[list[int]]:
    """The batch's positions, cut into runs whose first turn can be one ``generate_n`` request.

    A run holds consecutive trajectories of one group with the same prompt ids whose seeds
    count up by one (``seed, seed + 1, ...``: what the step's inputs hold); anything else is a
    run of one. Every position appears once, in order.
    """
    runs: list[list[int]] = []
    for i, item in enumerate(batch):
        if runs:
            prev = batch[runs[-1][-1]]
            if (
                item.group_id == prev.group_id
                and item.prompt_ids == prev.prompt_ids
                and item.seed == prev.seed + 1
            ):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs
