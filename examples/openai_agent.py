"""A two-turn tool-calling agent written only against the ``openai`` SDK, trained as it is.

Run it from the repository root (``examples`` is importable from there)::

    .venv/bin/python -m trainer generator.cls=examples.openai_agent:CalculatorAgent

The agent (:func:`calculator_agent`) is plain OpenAI-client code with no import of this
project: it asks the question, reads the model's first reply as a tool call (the name of a
calculator operation: ``max``, ``min``, ``sum``, ...), runs the tool on the question's
numbers, sends the result back as a ``tool`` message, and scores the model's second reply
against the answer. The built-in tiny model has no tool-call parser (``vllm serve`` would
need ``--enable-auto-tool-choice``), so the call is parsed from the reply's text, as agents
for small models do. Words the model reads must be in its vocabulary
(``engines.models.WORDS``).

:class:`CalculatorAgent` is the only project code: it plugs the agent into
:class:`~trainer.generators.openai_agent.OpenAIAgentGenerator`, which hands it an
``openai.AsyncOpenAI`` pointed at the run's engines and trains on the tokens the engine
returned for both turns (the tool message's tokens are loss-masked).
"""

from __future__ import annotations

import re
from typing import Any

from openai import AsyncOpenAI

from trainer.generators.openai_agent import OpenAIAgentGenerator

__all__ = [
    "KEEP_EVERY_TOKEN",
    "TOOLS",
    "TOOL_CALL_CREDIT",
    "CalculatorAgent",
    "calculator_agent",
    "score",
]

#: vLLM's ``skip_special_tokens=False``: the reply's text keeps every token the model sampled
#: (the untrained tiny model samples ``<pad>`` and ``<unk>``, which would otherwise vanish),
#: so the reply sent back as the assistant message renders to exactly the sampled tokens and
#: the second call's prompt extends the first call's (one training sample per trajectory).
#: No stop strings either: vLLM cuts a stop string out of the text but not out of the tokens.
KEEP_EVERY_TOKEN = {"skip_special_tokens": False}

#: The reward for calling a tool, and again for calling the right one (see calculator_agent).
TOOL_CALL_CREDIT = 0.25

#: The calculator's operations, by the word that calls them.
TOOLS = {
    "max": max,
    "min": min,
    "sum": lambda a, b: (a + b) % 10,
    "add": lambda a, b: (a + b) % 10,
    "sub": lambda a, b: abs(a - b),
    "mul": lambda a, b: (a * b) % 10,
}


def score(reply: str, answer: str) -> float:
    """1.0 for exactly the answer, 0.5 when it comes first, 0.1 for another lone digit."""
    words = reply.split()
    if words == [answer]:
        return 1.0
    if words and words[0] == answer:
        return 0.5
    return 0.1 if len(words) == 1 and words[0].isdigit() else 0.0


async def calculator_agent(client: AsyncOpenAI, item: Any) -> float:
    """Ask, run the tool the model called, return its result, score both turns.

    The reward is shaped so that an untrained model learns within a few dozen steps:
    ``TOOL_CALL_CREDIT`` for calling a calculator tool at all, as much again when the tool's
    result is the answer (the right tool), plus the rest times :func:`score` of the final
    reply.
    """
    messages: list[Any] = [{"role": "user", "content": item.prompt}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=4, extra_body=KEEP_EVERY_TOKEN
    )
    call = first.choices[0].message.content or ""
    numbers = [int(d) for d in re.findall(r"\d", item.prompt)][:2]
    tool = next((TOOLS[w] for w in call.split() if w in TOOLS), None)
    value = tool(*numbers) if tool and len(numbers) == 2 else None
    messages += [
        {"role": "assistant", "content": call},
        {
            "role": "tool",
            "tool_call_id": "call-0",
            "content": "error" if value is None else f"result {value}",
        },
    ]
    second = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=4, extra_body=KEEP_EVERY_TOKEN
    )
    reward = 0.0
    if value is not None:
        reward += TOOL_CALL_CREDIT * (1 + (str(value) == item.answer))
    final = score(second.choices[0].message.content or "", item.answer)
    return reward + (1 - 2 * TOOL_CALL_CREDIT) * final


class CalculatorAgent(OpenAIAgentGenerator):
    """Trains :func:`calculator_agent` (an asyncio agent: the ``openai`` SDK)."""

    async def agent(self, client: Any, item: Any) -> float:
        return await calculator_agent(client, item)
