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
from contextvars import ContextVar

import attrs

from engines.types import Completion, SamplingParams
from trainer.data import count_reward_failures
from trainer.generators._base import (
    Generator,
    GeneratorInput,
    GeneratorOutput,
    Trajectory,
    TrajectoryInput,
)
from trainer.vocabulary import fire_fault, open_owner_nursery, operation

__all__ = ["AgentLoopGenerator", "EnvStep", "shared_first_turns"]

#: Where each model turn of the rollout running in this task begins in its response
#: (:meth:`AgentLoopGenerator.last_turn_ids`); every rollout is its own trio task.
_turn_starts: ContextVar[list[int]] = ContextVar("turn_starts")


@attrs.frozen
class EnvStep:
    """What the environment answers after a model turn."""

    #: True ends the trajectory; ``reward`` is then its reward.
    done: bool
    reward: float = 0.0
    #: Text appended to the conversation for the next model turn (loss-masked).
    observation: str = ""
    #: Numbers this step reports (``{"tool_calls": 1.0}``): added up over the trajectory's
    #: steps into ``Trajectory.metrics``; the step's ``metrics.jsonl`` line has their mean
    #: over the batch's trajectories as ``generate/<name>`` (a trajectory that never
    #: reported a name counts 0; a name no trajectory of the batch reported is left out).
    metrics: dict[str, float] = attrs.field(factory=dict)


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

        with count_reward_failures() as reward_failures:
            async with open_owner_nursery() as nursery:
                for indices in shared_first_turns(batch):
                    if len(indices) > 1:
                        nursery.start_soon(run_group, indices)
                    else:
                        nursery.start_soon(run_one, indices[0], None)
        trajectories = [t for t in results if t is not None]
        assert len(trajectories) == len(batch)
        names = sorted({name for t in trajectories for name in t.metrics})
        return GeneratorOutput(
            trajectories,
            metrics={
                "generate/num_turns_mean": statistics.fmean(t.num_turns for t in trajectories),
                "generate/truncated_frac": statistics.fmean(
                    t.finish_reason in ("length", "truncated") for t in trajectories
                ),
                **{
                    f"generate/{name}": statistics.fmean(
                        t.metrics.get(name, 0.0) for t in trajectories
                    )
                    for name in names
                },
                **reward_failures.metrics(),
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
        reported: dict[str, float] = {}
        starts: list[int] = []  # where each model turn's tokens begin in ``response``
        token = _turn_starts.set(starts)
        try:
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
                starts.append(len(response))
                response += completion.token_ids
                mask += [1] * len(completion.token_ids)
                logprobs += completion.logprobs
                versions += completion.weight_versions or [-1] * len(completion.token_ids)
                finish = completion.finish_reason
                with operation("env_step"):
                    await fire_fault("env_step")
                    step = await self.env_step(item, response, turn)
                for name, value in step.metrics.items():
                    reported[name] = reported.get(name, 0.0) + float(value)
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
        finally:
            _turn_starts.reset(token)
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
            metrics=reported,
        )

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        """Single-turn default: score the response with the reward function and stop.

        The reward function gets the example's extra fields when it takes them
        (``extra=item.extra``; see :func:`trainer.data._examples.reward_function`). It runs
        where ``data.reward_workers`` says, bounded by ``data.reward_timeout_s``
        (:meth:`~trainer.data.RewardFunction.score`); its failures are counted per
        :meth:`generate` call (``reward/timeouts``, ``reward/errors``).
        """
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        reward = await self.reward_fn.score(text, item.answer, extra=item.extra)
        return EnvStep(done=True, reward=reward)

    def last_turn_ids(self, response_ids: list[int]) -> list[int]:
        """The tokens of the model's latest turn: what it sampled after the last observation.

        For :meth:`env_step` (and anything else a :meth:`rollout` calls), given the
        ``response_ids`` it was handed; on turn 0 that is the whole response. Raises
        ``RuntimeError`` outside a rollout, where there is no latest turn.
        """
        starts = _turn_starts.get(None)
        if not starts:
            raise RuntimeError(
                "last_turn_ids() is for env_step and other code a rollout calls: no model "
                "turn is in progress here"
            )
        return response_ids[starts[-1] :]

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
