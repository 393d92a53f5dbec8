"""A multi-turn environment behind HTTP, and the generator whose ``env_step`` calls it.

Environments of real agent training (sandboxes, browsers, game servers) are services: each
environment step is a network call that takes a while. Start the service, then train
against it (here with the fully-async strategy, so rollouts keep calling it while the
policy trains and while weights reach the engines)::

    .venv/bin/python -m examples.http_env --port 8765 --delay-s 0.2 --turns 3 &
    .venv/bin/python -m trainer trainer.strategy=fully_async \
        generator.cls=examples.http_env:HttpEnvGenerator \
        generator.kwargs.env_url=http://127.0.0.1:8765/step generator.max_turns=3

The service (:func:`serve`) answers ``POST /step`` with ``{"done": bool, "observation":
str}`` after ``--delay-s`` seconds: ``done`` once the trajectory has had ``--turns`` model
turns, otherwise an observation of words of the built-in tokenizer. ``GET /stats`` reports
how many requests it served and the most it had in flight at once.

:class:`HttpEnvGenerator` posts each model turn to it; each call has ``env_timeout_s`` in
all (a cancel scope around it, like aiohttp's ``ClientTimeout(total=...)``). A timeout ends the trajectory with reward 0 and is counted:
``env/timeouts_total`` in the step's metrics (the total so far, never reset). A run whose
event loop never stalls has none, however slow a weight transfer is.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import threading
import time
from contextvars import ContextVar
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import trio

from trainer.generators import GeneratorInput, GeneratorOutput, TrajectoryInput
from trainer.generators.agent_loop import AgentLoopGenerator, EnvStep

__all__ = ["OBSERVATION", "HttpEnvGenerator", "serve"]

#: What the service says after a model turn that does not end the trajectory.
OBSERVATION = "no , what is the answer ?"


#: The HTTP client of the ``generate`` call a rollout belongs to (its tasks inherit it).
_client: ContextVar[httpx.AsyncClient] = ContextVar("http_env_client")


class HttpEnvGenerator(AgentLoopGenerator):
    """The agent loop with an HTTP environment: ``env_step`` is ``POST env_url``.

    Configured with ``generator.kwargs.env_url=URL`` (and optionally
    ``generator.kwargs.env_timeout_s=S``, default 1.0). The reward of a trajectory is the
    reward function's score of its last model turn, once the service says it is done.

    Each ``generate`` call opens one HTTP client for its rollouts and closes it when they
    are done (its owner is the call, like the rollouts' nursery). The TLS context is built
    once, here: loading CA certificates takes tens of milliseconds of CPU, which on the
    event loop would stall every rollout in flight.
    """

    def __init__(self, *, env_url: str, env_timeout_s: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.env_url = env_url
        self.env_timeout_s = env_timeout_s
        self.timeouts = 0
        self._tls = ssl.create_default_context()

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        async with httpx.AsyncClient(timeout=self.env_timeout_s, verify=self._tls) as client:
            token = _client.set(client)
            try:
                out = await super().generate(batch)
            finally:
                _client.reset(token)
        out.metrics["env/timeouts_total"] = float(self.timeouts)
        return out

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        body = {"trajectory_id": item.trajectory_id, "turn": turn, "response": text}
        # the whole call has env_timeout_s (httpx's own timeouts bound each read and write)
        with trio.move_on_after(self.env_timeout_s) as deadline:
            try:
                reply = await _client.get().post(self.env_url, json=body)
                reply.raise_for_status()
                answer = reply.json()
            except httpx.TimeoutException:
                deadline.cancel()
        if deadline.cancel_called:  # timed out, or answered only after the deadline
            self.timeouts += 1
            return EnvStep(done=True, reward=0.0)
        if answer["done"]:
            last = text.rsplit(OBSERVATION, 1)[-1]
            return EnvStep(done=True, reward=float(self.reward_fn(last, item.answer)))
        return EnvStep(done=False, observation=answer["observation"])


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0


def serve(host: str, port: int, delay_s: float, turns: int) -> ThreadingHTTPServer:
    """The environment service, bound (``server_address`` has the port) and not yet serving."""
    stats = _Stats()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            with stats.lock:
                self._reply({"requests": stats.requests, "peak_in_flight": stats.peak_in_flight})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with stats.lock:
                stats.requests += 1
                stats.in_flight += 1
                stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
            try:
                time.sleep(delay_s)  # the environment at work
                done = int(request["turn"]) + 1 >= turns
                self._reply({"done": done, "observation": "" if done else OBSERVATION})
            finally:
                with stats.lock:
                    stats.in_flight -= 1

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def finish(self) -> None:
            try:
                super().finish()
            except OSError:
                pass  # the rollout was cancelled (its run ended) before the reply

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        # socketserver's default backlog is 5: 32 rollouts connecting at once would overflow
        # it, and a dropped SYN is retried after 1 s, past the client's timeout
        request_queue_size = 256

        def handle_error(self, request: Any, client_address: Any) -> None:
            if not isinstance(sys.exc_info()[1], OSError):  # a cancelled client's closed socket
                super().handle_error(request, client_address)

    return Server((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--delay-s", type=float, default=0.2, help="seconds per step")
    parser.add_argument("--turns", type=int, default=3, help="model turns per trajectory")
    args = parser.parse_args()
    server = serve(args.host, args.port, args.delay_s, args.turns)
    print(f"http://{args.host}:{server.server_address[1]}/step", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
