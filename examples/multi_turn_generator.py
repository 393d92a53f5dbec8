"""A two-turn environment: a wrong first answer gets "no , what is the answer ?" and a retry.

Run it from the repository root (``examples`` is importable from there)::

    .venv/bin/python -m trainer generator.cls=examples.multi_turn_generator:RetryOnWrongGenerator \
        generator.max_turns=2 generator.kwargs.retry_discount=0.25

How it plugs into the agent loop (``trainer.generators.agent_loop``): after every model turn
the loop awaits ``env_step(item, response_ids, turn)``. Returning ``EnvStep(done=False,
observation=TEXT)`` makes the loop append ``TEXT``'s tokens to the response with loss mask 0
(the policy is not trained on them; their rollout logprobs are 0.0) and sample the next
model turn from prompt + everything so far, as tokens (nothing is re-tokenized). With chat
prompts (a data file whose ``prompt`` is a list of messages) the observation is appended as
a ``user`` chat turn, rendered on its own with the chat template
(``AgentLoopGenerator.observation_tokens``); with text prompts as its plain tokens. ``EnvStep(done=True, reward=R)`` ends the
trajectory with reward ``R``. ``self.last_turn_ids(response_ids)`` is the model's latest
turn alone, and ``EnvStep(metrics=...)`` reports numbers of the environment's own
(``generate/retries``, ``generate/solved`` in ``metrics.jsonl``: their means over the batch). The observation uses only words of the built-in tiny
tokenizer's vocabulary (``engines.models.WORDS``); an unknown word would become ``<unk>``.
"""

from __future__ import annotations

from typing import Any

from trainer.generators import AgentLoopGenerator, EnvStep, TrajectoryInput

__all__ = ["RETRY_OBSERVATION", "RetryOnWrongGenerator"]

#: What the environment says after a wrong first answer.
RETRY_OBSERVATION = "no , what is the answer ?"


class RetryOnWrongGenerator(AgentLoopGenerator):
    """Scores each model turn; a wrong answer before the last turn earns a retry.

    The reward of a trajectory is that of its last model turn, times ``retry_discount`` per
    retry, so answering right the first time pays most. With ``generator.max_turns=1`` it
    behaves like the default single-turn generator.

    ``retry_discount`` is a constructor option: ``generator.kwargs.retry_discount=0.25`` on the
    command line. The reward function gets the example's extra fields when it takes them.
    """

    def __init__(self, *, retry_discount: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Reward factor per retry taken.
        self.retry_discount = retry_discount

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        text = self.tokenizer.decode(self.last_turn_ids(response_ids), skip_special_tokens=True)
        reward = float(self.reward_fn(text, item.answer, extra=item.extra))
        if reward >= 1.0 or turn + 1 >= self.max_turns:
            # generate/solved in metrics.jsonl: the share of trajectories that got it right
            solved = {"solved": 1.0 if reward >= 1.0 else 0.0}
            return EnvStep(done=True, reward=reward * self.retry_discount**turn, metrics=solved)
        return EnvStep(done=False, observation=RETRY_OBSERVATION, metrics={"retries": 1.0})
