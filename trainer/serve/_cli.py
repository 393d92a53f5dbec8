"""``python -m trainer serve [--config FILE.yaml] [key=value ...]``: the training service.

It reads the same configuration as training (``serve.*`` keys; ``--help`` lists them all),
refuses a bad one in one line per problem (exit 2), binds ``serve.host:serve.port`` (loopback
by default), prints one ready line, ``TRAINER_SERVE_READY url=http://HOST:PORT``, and serves
until SIGINT or SIGTERM, when in-flight requests get :data:`GRACEFUL_TIMEOUT_S` to finish.

How the exit is bounded when an operation hangs: the operation's request answered at its
deadline already, and its model is broken; the thread still blocked in it was abandoned by
trio (``abandon_on_cancel``), and trio's worker threads are daemon threads, so neither the
nursery (cancelled once hypercorn has stopped) nor the interpreter's exit waits for it. The
exit takes the graceful timeout at most, plus unwinding: measured in
``tests/tinker/test_hang.py``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from functools import partial
from pathlib import Path

import attrs
import trio

from trainer.config import ROLLOUT_LOGPROBS_MODE, TINY_MODEL_NAME, Config, load_config
from trainer.errors import ConfigError
from trainer.serve._app import ServiceApp, ServiceSpec
from trainer.serve._engine import VLLM_MAX_LORA_RANK, SamplerSettings, open_sampler_engines
from trainer.serve._sessions import end_idle_sessions_forever
from trainer.vocabulary import install_faults

__all__ = ["READY_PREFIX", "serve", "serve_main"]

log = logging.getLogger(__name__)

#: The first word of the line printed once the service listens.
READY_PREFIX = "TRAINER_SERVE_READY"
GRACEFUL_TIMEOUT_S = 2.0
#: Idle client connections stay open this long (the SDK keeps a pool of them).
KEEP_ALIVE_TIMEOUT_S = 300.0

USAGE = """\
usage: python -m trainer serve [--config FILE.yaml] [key=value ...]

The Tinker-protocol training service (docs/tinker.md): the official SDK's ServiceClient(
base_url="http://127.0.0.1:8000") trains LoRA adapters on this machine. Keys: serve.host,
serve.port, serve.base_models, serve.request_timeout_s, serve.checkpoint_dir,
serve.session_timeout_s, serve.future_ttl_s, and faults (e.g. faults=forward_backward:hang@2
rehearses a hang); the key clients must send comes from TRAINER_SERVE_API_KEY (tml-...).
`python -m trainer --help` lists every key.
"""


def _model_dir(name: str):
    from engines.models import resolve_model_path

    return resolve_model_path(None if name == TINY_MODEL_NAME else name)


def _available(name: str) -> bool:
    """Whether ``name`` can be loaded here without converting anything (cheap)."""
    if name == TINY_MODEL_NAME:
        return True
    from engines.gguf_models import gguf_source

    try:
        return gguf_source(name) is not None or (Path(name).expanduser() / "config.json").is_file()
    except ConfigError:
        return False


def spec_of(cfg: Config) -> ServiceSpec:
    """What ``cfg``'s ``serve`` section offers. ``ConfigError`` without a key."""
    serve_cfg = cfg.serve
    if serve_cfg.api_key is None:
        raise ConfigError(
            "serve needs a key for its clients: set TRAINER_SERVE_API_KEY=tml-... and give the "
            "SDK the same as TINKER_API_KEY"
        )
    names = serve_cfg.base_models
    return ServiceSpec(
        base_models={name: partial(_model_dir, name) for name in names},
        available={name: _available(name) for name in names},
        timeout_s=serve_cfg.request_timeout_s,
        api_key=serve_cfg.api_key,
        sampling=_sampler_settings(cfg),
        checkpoint_dir=Path(serve_cfg.checkpoint_dir).expanduser(),
        session_timeout_s=serve_cfg.session_timeout_s,
        future_ttl_s=serve_cfg.future_ttl_s,
    )


def _sampler_settings(cfg: Config) -> SamplerSettings:
    """The sampling engines' settings: ``engine.*`` (the reference engine's servers, or
    ``vllm serve``'s, as a run starts them) and ``sync.*`` (the sampler saves' sync and its
    check)."""
    plan = cfg.plan
    if not plan.engine_backend.starts_servers:  # the service starts its engines' servers
        raise ConfigError(
            f"serve: engine.backend={cfg.engine.backend!r} does not sample for the service: "
            "use engine.backend=local (the reference engine) or vllm (docs/tinker.md)"
        )
    vllm = None
    if plan.vllm is not None:  # adapters go by route: LoRA on, no weight-transfer engine
        vllm = attrs.evolve(
            plan.vllm, max_lora_rank=VLLM_MAX_LORA_RANK, weight_transfer_backend=None
        )
    return SamplerSettings(
        seed=cfg.trainer.seed,
        startup_timeout_s=plan.timeouts.engine_startup_s,
        control_plane_timeout_s=plan.timeouts.control_plane_s,
        verify=cfg.sync.verify,
        verify_tolerance=cfg.sync.verify_tolerance,
        transfer_grace_s=cfg.sync.transfer_grace_s,
        pause_mode=cfg.engine.pause_mode,
        num_threads=None if plan.threads is None else plan.threads.server,
        logprobs_mode=ROLLOUT_LOGPROBS_MODE,
        vllm=vllm,
    )


async def serve(cfg: Config, spec: ServiceSpec) -> None:
    """Serve until SIGINT or SIGTERM. Every task (the HTTP server, each model's runner) is
    owned by one nursery, cancelled when the server has stopped; the sampling engines are
    stopped after it."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    shutdown = trio.Event()
    host = f"[{cfg.serve.host}]" if ":" in cfg.serve.host else cfg.serve.host
    config = HypercornConfig()
    config.bind = [f"{host}:{cfg.serve.port}"]
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    async with open_sampler_engines(spec.sampling) as engines, trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, shutdown)
        app = ServiceApp(spec, nursery, engines)
        nursery.start_soon(end_idle_sessions_forever, app)
        async with trio.open_nursery() as server:  # returns when hypercorn has shut down
            binds = await server.start(
                partial(hypercorn_serve, app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
            )
            port = int(binds[0].rsplit(":", 1)[1])
            print(f"{READY_PREFIX} url=http://{host}:{port}", flush=True)
        # the models' runners and the threads they wait on end with the service
        nursery.cancel_scope.cancel()


async def _watch_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            shutdown.set()
            return


def serve_main(argv: list[str]) -> int:
    """The ``serve`` subcommand; its exit status (2 for a bad configuration)."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    parser = argparse.ArgumentParser(prog="python -m trainer serve", add_help=False)
    parser.add_argument("--config")
    args, overrides = parser.parse_known_args(argv)
    flags = [o for o in overrides if o.startswith("-")]
    try:
        if flags:
            raise ConfigError(f"unknown option {flags[0]!r}")
        cfg = load_config(args.config, overrides)
        spec = spec_of(cfg)
    except ConfigError as exc:
        headline, *details = str(exc).split("\n")
        for line in details:
            print(f"  {line}", file=sys.stderr)
        suffix = " (above)" if details else ""
        print(f"ConfigError: {headline}{suffix}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # the operations' fault points (forward, forward_backward) fire where they run: rehearse a
    # hang with faults=forward_backward:hang (DESIGN 4.5)
    install_faults(cfg.faults)
    trio.run(serve, cfg, spec)
    # an operation's thread abandoned past its deadline is a daemon thread (trio's): the
    # interpreter exits without joining it, so a hung one cannot hold the exit
    return 0
