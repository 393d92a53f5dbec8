"""Train agents written against OpenAI's API: the agent gets a client, the trainer the tokens.

::

    from trainer.generators.openai_agent import OpenAIAgentGenerator

    class MyAgent(OpenAIAgentGenerator):
        async def agent(self, client, item):          # client: openai.AsyncOpenAI
            reply = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": item.prompt}]
            )
            return float(reply.choices[0].message.content.strip() == item.answer)

Each trajectory of a step runs ``agent(client, item)`` once, all of them concurrently, and
its return value is the trajectory's reward. ``client`` talks to a token-capturing proxy
(:mod:`trainer.generators.token_capture`) in front of the run's engines, at a base URL of the
trajectory's own, so every model call is routed to the trajectory's engine and recorded
from the engine's token ids. The calls become training samples by the extension property
(:mod:`trainer.generators.turns`): model tokens have loss mask 1, whatever the agent inserted
between them (tool results, user turns, template markup) 0; a call whose prompt does not
extend the previous ones (a template that rewrites history) splits the trajectory into
separate samples with the same reward, counted in ``generate/trajectory_splits``.

``agent_runtime`` says what the agent is written for:

- ``"asyncio"`` (the default): ``client`` is an ``openai.AsyncOpenAI``; the agent runs as an
  asyncio task through the trio-asyncio bridge (:mod:`engines.bridge`) opened for the step;
- ``"trio"``: ``client`` is an ``httpx.AsyncClient`` whose ``base_url`` is the trajectory's
  OpenAI endpoint (``await client.post("chat/completions", json=...)``).

Cancellation: the step deadline cancels every agent; an asyncio agent gets
``asyncio.CancelledError`` where it awaits and unwinds before the step's
``StepTimeoutError`` is raised. The error names ``operation='generate'`` when the deadline
lands during a model call and ``'env_step'`` while an asyncio agent runs its own code (a
trio agent names its own operations; see docs/custom_generators.md). Nothing of a step
outlives its ``generate``: the proxy, the asyncio loop and the clients are closed before it
returns.

Needs engines reachable over HTTP (``engine.backend=local`` or ``remote``), and the
``openai`` package for asyncio agents (``pip install -e '.[agents]'``).
"""

from __future__ import annotations

import ssl
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Literal, cast

import httpx
import openai

from engines.bridge import Bridge, open_bridge
from engines.client import InferenceClient
from trainer.errors import ConfigError
from trainer.generators._base import (
    Generator,
    GeneratorInput,
    GeneratorOutput,
    Trajectory,
    TrajectoryInput,
)
from trainer.generators.token_capture import CaptureProxy, open_capture_proxy
from trainer.generators.turns import Sample, assemble
from trainer.vocabulary import open_owner_nursery, operation

__all__ = ["AgentRuntime", "OpenAIAgentGenerator", "run_asyncio_agent"]

#: What an agent is written for: asyncio (the ``openai`` SDK) or trio (``httpx``).
AgentRuntime = Literal["asyncio", "trio"]

Agent = Callable[[Any, TrajectoryInput], Awaitable[float]]


async def run_asyncio_agent(
    agent: Agent, base_url: str, item: TrajectoryInput, ssl_context: ssl.SSLContext
) -> float:
    """Asyncio side: ``agent(AsyncOpenAI(base_url), item)``; closes the client's connections.

    Each agent has a connection pool of its own, as an agent built by hand would: one pool
    shared by a step's agents grows to one connection per agent, and httpcore scans every
    connection of a pool on each request, which made a step of 128 agents stall the event
    loop for ~100 ms at a time. The step's clients share ``ssl_context``: building one costs
    ~30 ms of CPU, which each ``AsyncOpenAI`` would otherwise spend blocking the loop.
    """
    async with httpx.AsyncClient(timeout=None, verify=ssl_context) as http:
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key="trainer",
            max_retries=0,
            http_client=cast(Any, http),  # openai 3.x types it as httpx2's client
        )
        return float(await agent(client, item))


@asynccontextmanager
async def _maybe_bridge(needed: bool) -> AsyncIterator[Bridge | None]:
    if not needed:
        yield None
        return
    async with open_bridge() as bridge:
        yield bridge


class OpenAIAgentGenerator(Generator):
    """Runs :meth:`agent` per trajectory against the run's engines; see the module docstring."""

    #: ``"asyncio"``: :meth:`agent` gets ``openai.AsyncOpenAI``; ``"trio"``: ``httpx.AsyncClient``.
    agent_runtime: ClassVar[AgentRuntime] = "asyncio"
    _ssl_context: ssl.SSLContext | None = None

    async def agent(self, client: Any, item: TrajectoryInput) -> float:
        """The agent: talk to the model through ``client`` and return the trajectory's reward.

        ``item`` has the prompt (``item.prompt``), the reference answer (``item.answer``) and
        ``item.extra``. Override it (or assign a plain ``async def agent(client, item)`` with
        ``staticmethod``).
        """
        raise NotImplementedError(f"{type(self).__name__} must define agent(client, item)")

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        engine = self.engine
        if not isinstance(engine, InferenceClient):
            raise ConfigError(
                f"config: {type(self).__name__} needs engines served over HTTP "
                "(engine.backend=local or remote); it cannot reach "
                f"{type(engine).__name__}"
            )
        rewards: list[float | None] = [None] * len(batch)
        if self._ssl_context is None:  # once per run (see run_asyncio_agent)
            self._ssl_context = ssl.create_default_context()
        ssl_context = self._ssl_context
        async with (
            open_capture_proxy(engine, self.sampling) as proxy,
            _maybe_bridge(self.agent_runtime == "asyncio") as bridge,
        ):
            urls = [proxy.register(item.trajectory_id, item.seed) for item in batch]

            async def run_one(i: int) -> None:
                rewards[i] = await self._run_agent(bridge, ssl_context, urls[i], batch[i])

            async with open_owner_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(run_one, i)
            return self._output(batch, proxy, [r for r in rewards if r is not None])

    async def _run_agent(
        self, bridge: Bridge | None, ssl_context: ssl.SSLContext, url: str, item: TrajectoryInput
    ) -> float:
        agent: Agent = self.agent
        if bridge is not None:
            with operation("env_step"):  # the asyncio agent's own awaits (tools, environments)
                return await bridge.run(run_asyncio_agent, agent, url, item, ssl_context)
        async with httpx.AsyncClient(base_url=url, timeout=None, verify=ssl_context) as client:
            return float(await agent(client, item))

    def _output(
        self, batch: GeneratorInput, proxy: CaptureProxy, rewards: list[float]
    ) -> GeneratorOutput:
        trajectories: list[Trajectory] = []
        splits = 0
        calls: list[int] = []
        for item, reward in zip(batch, rewards, strict=True):
            turns = proxy.turns(item.trajectory_id)
            calls.append(len(turns))
            samples, split = assemble(turns)
            splits += split
            if not samples:  # the agent never called the model: nothing to train, a reward
                samples = [Sample(prompt_ids=list(item.prompt_ids), finish_reason="stop")]
            trajectories += [self._trajectory(s, item, reward) for s in samples]
        return GeneratorOutput(
            trajectories,
            metrics={
                "generate/num_turns_mean": statistics.fmean(calls),
                "generate/trajectory_splits": float(splits),
                "generate/samples_per_trajectory": len(trajectories) / len(batch),
                "generate/truncated_frac": statistics.fmean(
                    t.finish_reason == "truncated" for t in trajectories
                ),
            },
        )

    def _trajectory(self, sample: Sample, item: TrajectoryInput, reward: float) -> Trajectory:
        """A sample as a ``Trajectory``, cut at ``max_response_tokens`` (``truncated``)."""
        keep = self.max_response_tokens
        finish = sample.finish_reason
        if len(sample.response_ids) > keep:
            finish = "truncated"
        response = sample.response_ids[:keep]
        mask = sample.loss_mask[:keep]
        text = self.tokenizer.decode(
            [t for t, m in zip(response, mask) if m], skip_special_tokens=True
        )
        return Trajectory(
            prompt_ids=sample.prompt_ids,
            response_ids=response,
            loss_mask=mask,
            reward=reward,
            rollout_logprobs=sample.logprobs[:keep],
            group_id=item.group_id,
            finish_reason=finish,
            num_turns=sample.num_turns,
            response_text=text,
        )
