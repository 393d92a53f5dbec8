"""The reference server's generation routes, ``/v1/completions``, ``/v1/chat/completions`` and
the token-in ``/inference/v1/generate``:
requests validated as vLLM validates them, generated on the engine (every prompt and choice
concurrently), answered whole or streamed as server-sent events. :class:`CompletionRoutes` is
the half of :class:`~engines.local.server.ServerApp` that holds them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import trio

from engines.local.chat_protocol import chat_response, parse_chat_request
from engines.local.engine import LocalEngine
from engines.local.http import (
    Request,
    Response,
    json_response,
)
from engines.local.lora import Adapter
from engines.local.protocol import (
    ProtocolError,
    completion_response,
    parse_completion_request,
    parse_json_object,
)
from engines.local.requests import EngineAsleepError, EngineDeadError
from engines.local.streaming import ChatChunks, ChunkFormat, CompletionChunks, stream_events
from engines.local.token_protocol import parse_token_request, token_response
from engines.local.validation import GenerationOptions, refusal
from engines.types import Completion, SamplingParams

__all__ = ["CompletionRoutes"]


class CompletionRoutes:
    """The generation routes, over the engine :class:`~engines.local.server.ServerApp` holds."""

    engine: LocalEngine
    served_model: str
    max_model_len: int

    def _served(self, body: dict[str, object]) -> tuple[str, Adapter | None]:
        """The model a request names and its LoRA adapter: a loaded adapter's name samples
        through it, anything else is checked against the served model (404 as vLLM)."""
        model = body.get("model")
        adapter = self.engine.adapters.get(model) if isinstance(model, str) else None
        return (adapter.name, adapter) if adapter is not None else (self.served_model, None)

    async def completions(self, request: Request) -> Response:
        tok = self.engine.tokenizer
        body = parse_json_object(request.body)
        model, adapter = self._served(body)
        req = parse_completion_request(
            body,
            served_model=model,
            encode=lambda text: list(tok.encode(text, add_special_tokens=True)),
            vocab_size=self.engine.vocab_size,
            max_model_len=self.max_model_len,
        )
        jobs = [(p, req.params_for(j)) for p in req.prompts for j in range(req.n)]
        if req.options.stream:
            fmt = CompletionChunks(
                req.model,
                [p for p, _ in jobs],
                req.logprobs,
                req.return_token_ids,
                tok.convert_ids_to_tokens,
            )
            return self._event_stream(jobs, fmt, req.options, adapter)
        done = await self._generate_all(jobs, adapter)
        payload = completion_response(
            req,
            [done[i * req.n : (i + 1) * req.n] for i in range(len(req.prompts))],
            decode=self._decoder(req.options),
            convert_ids_to_tokens=tok.convert_ids_to_tokens,
            decode_one=self._token_text,
        )
        return json_response(payload)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_json_object(request.body)
        model, adapter = self._served(body)
        req = parse_chat_request(
            body,
            served_model=model,
            render=self._render_chat,
            max_model_len=self.max_model_len,
        )
        jobs = [(req.prompt_ids, req.params_for(j)) for j in range(req.n)]
        if req.options.stream:
            fmt = ChatChunks(
                req.model,
                req.prompt_ids,
                req.logprobs,
                req.options.return_token_ids,
                self._token_text,
            )
            return self._event_stream(jobs, fmt, req.options, adapter)
        done = await self._generate_all(jobs, adapter)
        return json_response(
            chat_response(req, done, decode=self._decoder(req.options), token_text=self._token_text)
        )

    async def generate_tokens(self, request: Request) -> Response:
        """``POST /inference/v1/generate`` (:mod:`engines.local.token_protocol`)."""
        body = parse_json_object(request.body)
        model, adapter = self._served(body)
        req = parse_token_request(
            body,
            served_model=model,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.max_model_len,
        )
        done = await self._generate_all(
            [(req.prompt_ids, req.params_for(j)) for j in range(req.n)], adapter
        )
        return json_response(token_response(req, done, decode_one=self._token_text))

    def _decoder(self, options: GenerationOptions) -> Callable[[list[int]], str]:
        """Token ids to text as the request asked (``skip_special_tokens``)."""
        return partial(
            self.engine.tokenizer.decode, skip_special_tokens=options.skip_special_tokens
        )

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _render_chat(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool,
        kwargs: dict[str, object],
    ) -> list[int]:
        """The prompt ids of a conversation: the chat template's text, tokenized without
        special tokens (the template writes them), as vLLM renders chat."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ProtocolError(
                400,
                "the model has no chat template (tokenizer_config.json chat_template): "
                "use /v1/completions, or give the model a template",
                "messages",
            )
        try:
            text = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja errors of a template: the request's fault
            raise ProtocolError(400, f"the chat template failed: {exc}", "messages") from None
        ids = list(tok.encode(str(text), add_special_tokens=False))
        if any(not 0 <= t < self.engine.vocab_size for t in ids):
            raise ProtocolError(400, "the rendered prompt has ids outside the vocabulary")
        return ids

    async def _generate_all(
        self, jobs: list[tuple[list[int], SamplingParams]], adapter: Adapter | None
    ) -> list[Completion]:
        """One completion per ``(prompt ids, params)`` through ``adapter`` (None: the base),
        concurrently (they batch); 409 while the engine sleeps."""
        results: list[Completion | None] = [None] * len(jobs)
        refused: list[ProtocolError] = []

        async def one(i: int) -> None:
            try:
                results[i] = await self.engine.generate(*jobs[i], adapter=adapter)
            except (EngineAsleepError, EngineDeadError) as exc:
                refused.append(refusal(exc))

        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(one, i)
        if refused:
            raise refused[0]
        return [c for c in results if c is not None]

    def _event_stream(
        self,
        jobs: list[tuple[list[int], SamplingParams]],
        fmt: ChunkFormat,
        options: GenerationOptions,
        adapter: Adapter | None,
    ) -> Response:
        """A server-sent-events response generating ``jobs`` (:mod:`engines.local.streaming`)."""
        if self.engine.is_sleeping:  # refused before the 200 goes out, as a whole answer is
            raise ProtocolError(409, "the engine is sleeping; call /wake_up first")

        async def body(write: Callable[[bytes], Awaitable[None]]) -> None:
            await stream_events(
                write,
                partial(self.engine.generate, adapter=adapter),
                jobs,
                fmt,
                decode=self._decoder(options),
                include_stop_str=options.include_stop_str,
                include_usage=options.include_usage,
            )

        return Response(200, content_type="text/event-stream", stream=body)

    # -- control plane (engines.local.control_routes, and the weight-transfer routes) ------------
