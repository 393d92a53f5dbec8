"""An in-process verifiers 0.4 harness: one chat turn, asked in this process (no subprocess, no
``uv``, no sandbox; what ``Harness.launch``'s contract allows: the program may be any code
that calls the episode's endpoint).

It posts the task's system prompt and prompt to the episode's interception endpoint
(``.../chat/completions``, verifiers' own server, which calls the model through the run's
training client) and returns the reply as the program's output.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

__all__ = ["InProcessHarness"]

#: Seconds one model call may take (the step's deadline bounds it too).
CALL_TIMEOUT_S = 600.0


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One for all episodes: otherwise each client builds its own, ~20 ms of CPU (loading the
    CA store) on the event loop per episode."""
    return ssl.create_default_context()


class InProcessHarnessConfig(vf.HarnessConfig):
    pass


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: Any,
        data: Any,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S, verify=_ssl_context()) as client:
            reply = await client.post(
                endpoint.rstrip("/") + "/chat/completions",
                headers={"Authorization": f"Bearer {secret}"},
                json={"model": ctx.model, "messages": messages},
            )
        ok = reply.status_code == 200
        return vf.ProgramResult(
            exit_code=0 if ok else 1, stdout=reply.text, stderr="" if ok else reply.text
        )
