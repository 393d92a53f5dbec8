"""``python -m engines.local serve``: run the CPU reference engine behind its HTTP server.

::

    python -m engines.local serve [--model DIR] [--host 127.0.0.1] [--port 8000]
                                  [--api-key KEY] [--allow-keyless-control] [--seed N]
                                  [--exit-on-stdin-eof] [--no-weight-transfer]
                                  [--weight-dir DIR] [--weight-sync-hosts H1,H2]
                                  [--enable-sleep-mode]
                                  [--device auto|cpu|cuda|cuda:N]
                                  [--dtype auto|float32|bfloat16]

``--device auto`` (the default) runs on CUDA when this process sees a GPU, else on the CPU;
``--device cuda`` on a machine without one exits at once with a line saying what to do. On
CUDA the model is bfloat16 unless ``--dtype`` says otherwise; sampling stays on the CPU.

Its first line, on stderr, names its process id and process group (``engines.local serve: pid
N, process group N``: the first line of the log a launcher gives it). Once listening it prints
one line to stdout, ``ENGINE_READY port=N url=http://HOST:N``
(``--port 0`` picks a free port; launchers read the port from this line). SIGTERM/SIGINT
shut it down gracefully (in-flight requests get a couple of seconds), and so does the death
of its engine (a decode step over partial weights, as real vLLM's worker crashes), which
exits 1. With
``--exit-on-stdin-eof`` it also shuts down when its stdin reaches end-of-file: a launcher
that holds the write end of a pipe makes the server die with it, even on SIGKILL. It watches
from the first line of :func:`main`, before the model loads (a launcher that dies while the
server loads ends it then, not once it serves); before that, while this module's imports run,
the launchers' ``PR_SET_PDEATHSIG`` (:mod:`engines.launch.parent_death`) is what ties it to
them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial

import torch
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from engines.devices import DTYPES, resolve_device
from engines.launch import ready_line
from engines.local.decode import LOGPROBS_MODES
from engines.local.engine import DEFAULT_BATCH_WAIT_S, LocalEngine, open_local_engine
from engines.local.lora_routes import runtime_lora_updating
from engines.local.server import ServerApp
from engines.local.weight_routes import BACKENDS, DEFAULT_STORE_TIMEOUT_S, WeightReceiver
from engines.models import resolve_model_path
from engines.weight_access import (
    LOOPBACK_HOSTS,
    SYNC_HOSTS_ENV,
    WEIGHT_DIR_ENV,
    parse_hosts,
    sync_hosts_from_env,
    weight_dir_from_env,
)

__all__ = ["main", "serve"]

log = logging.getLogger("engines.local")

#: Seconds in-flight requests get to finish on shutdown.
GRACEFUL_TIMEOUT_S = 2.0
#: Seconds a server whose stdin closed may take to shut down before it kills itself.
STDIN_EOF_KILL_S = 10.0
#: Seconds an idle client connection stays open (hypercorn's default is 5 s): long enough
#: that a trainer's pool stays warm across the training stages between two generate stages.
KEEP_ALIVE_TIMEOUT_S = 300.0


def _weight_transfer_config(text: str) -> str:
    """``--weight-transfer-config '{"backend": "gloo"}'``: the backend it names."""
    try:
        backend = json.loads(text).get("backend")
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    if backend not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
        )
    return backend


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engines.local", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the reference engine over vLLM's HTTP protocol")
    _model_and_http_args(s)
    _weight_and_lifetime_args(s)
    return parser


def _model_and_http_args(s: argparse.ArgumentParser) -> None:
    """``serve``'s model, address, authentication, sampling seed, batching and device flags."""
    s.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (default: the built-in tiny model)",
    )
    s.add_argument(
        "--served-model-name", default=None, help="name in /v1/models (default: --model as given)"
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument(
        "--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)"
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but GET /health (env "
        "VLLM_API_KEY, which keeps the key out of the process list)",
    )
    s.add_argument(
        "--allow-keyless-control",
        action="store_true",
        help="without an API key, serve the control, weight-transfer, LoRA and statistics "
        "routes anyway (default: 403; only the data plane and /health are served): for a "
        "loopback server on a machine whose users you trust",
    )
    s.add_argument(
        "--seed", type=int, default=0, help="seed of the per-request samplers (default 0)"
    )
    s.add_argument("--max-num-seqs", type=int, default=256, help="most requests decoded together")
    s.add_argument(
        "--batch-wait-ms",
        type=float,
        default=1000 * DEFAULT_BATCH_WAIT_S,
        help="after idling, wait while requests keep arriving less than this apart before "
        f"the first step (default {1000 * DEFAULT_BATCH_WAIT_S:g}; 0 never waits)",
    )
    s.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="the most torch intra-op threads a decode step uses (default 1); with more, fewer "
        "while other processes hold the cores (a thread that must wait for a core makes each "
        "small forward pass many times slower), measured by how long they wait for one; 0 "
        "leaves torch's own count",
    )
    s.add_argument(
        "--device",
        default="auto",
        help="where the model and KV caches live: auto (CUDA when available, else the CPU), "
        "cpu, cuda or cuda:N (default auto)",
    )
    s.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="model dtype: auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16",
    )


def _weight_and_lifetime_args(s: argparse.ArgumentParser) -> None:
    """``serve``'s weight-transfer, sleep-mode and shutdown flags."""
    s.add_argument(
        "--no-weight-transfer",
        dest="weight_transfer_routes",
        action="store_false",
        help="serve no weight-transfer routes (404), as vllm serve without --weight-transfer-config",
    )
    s.add_argument(
        "--weight-transfer-config",
        type=_weight_transfer_config,
        default=None,
        help="as vllm serve: a JSON object whose 'backend' is one of "
        f"{', '.join(BACKENDS)} (nccl and ipc need CUDA); default: chosen by the first "
        "init_info (vLLM's nccl shape: nccl on a GPU, else gloo; its ipc shape: ipc)",
    )
    s.add_argument(
        "--weight-transfer-timeout-s",
        type=float,
        default=DEFAULT_STORE_TIMEOUT_S,
        help="bound of the weight-sync group's store and collectives on this server "
        f"(default {DEFAULT_STORE_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--weight-dir",
        default=weight_dir_from_env(),
        help="the only folder whose files a disk weight update may read (regular files under "
        f"it, no links followed; env {WEIGHT_DIR_ENV}); unset: disk updates are refused",
    )
    s.add_argument(
        "--weight-sync-hosts",
        type=parse_hosts,
        default=sync_hosts_from_env(),
        help="comma-separated addresses a gloo/nccl init_info's master_address may name "
        f"(env {SYNC_HOSTS_ENV}; default: loopback only, {', '.join(sorted(LOOPBACK_HOSTS))})",
    )
    s.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="serve /sleep and /wake_up (refused without it, as where vLLM cannot sleep; "
        "the reference sleeps on the CPU too)",
    )
    s.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: a request whose model names a loaded adapter samples "
        "through it (/v1/load_lora_adapter and /v1/unload_lora_adapter, with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True as vLLM wants it)",
    )
    s.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="--enable-lora: the largest adapter rank a load accepts (vLLM's default 16)",
    )
    s.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="--enable-lora: accepted as vLLM's flag (adapters in one batch); the reference "
        "engine batches any number",
    )
    s.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what completion logprobs are of, as vLLM's flag: raw_logprobs (the model's "
        "logits, the default) or processed_logprobs (over the request's temperature: the "
        "distribution the token was sampled from, as the trainer's own logprobs)",
    )
    s.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="shut down when stdin closes (launchers hold a pipe so the server dies with them)",
    )


async def _watch_signals(on_signal: Callable[[], None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received signal %d: shutting down", signum)
            on_signal()


def _exit_on_stdin_eof() -> None:
    """Block on stdin until end-of-file (a daemon thread, started first thing in :func:`main`,
    before the model loads), then SIGTERM this process: before it serves, the default action
    ends it at once; once it serves, a graceful shutdown. SIGKILL if it still runs
    :data:`STDIN_EOF_KILL_S` later (a load that does not end, a shutdown that hangs)."""
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except OSError:
        pass
    log.info("stdin closed (the launcher is gone): shutting down")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STDIN_EOF_KILL_S)
    log.error("still running %gs after stdin closed: killing this process", STDIN_EOF_KILL_S)
    os.kill(os.getpid(), signal.SIGKILL)


async def _watch_death(engine: LocalEngine, on_death: Callable[[], None]) -> None:
    await engine.died.wait()
    log.error("the engine died: shutting down (the requests in flight are answered 500)")
    on_death()


async def serve(args: argparse.Namespace) -> bool:
    """Load the model, serve until SIGTERM/SIGINT (or stdin EOF with the flag), then return
    whether it ended because the engine died (real vLLM's server exits then too: its
    ``EngineDeadError``; :mod:`engines.local.engine` says when the reference's dies)."""
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    resolve_device(args.device, key="--device")  # refuse CUDA where there is none, at once
    model_dir = await trio.to_thread.run_sync(resolve_model_path, args.model)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, shutdown.set)
        async with open_local_engine(
            model_dir,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            batch_wait_s=args.batch_wait_ms / 1000,
            device=args.device,
            dtype=args.dtype,
            threads=args.num_threads if args.num_threads > 0 else None,
            max_lora_rank=args.max_lora_rank if args.enable_lora else None,
            logprobs_mode=args.logprobs_mode,
        ) as engine:
            nursery.start_soon(_watch_death, engine, shutdown.set)
            app = ServerApp(
                engine,
                served_model=args.served_model_name or args.model or str(model_dir),
                api_key=args.api_key,
                control_without_key=args.allow_keyless_control,
                weight_transfer_routes=args.weight_transfer_routes,
                sleep_mode=args.enable_sleep_mode,
                lora_routes=args.enable_lora and runtime_lora_updating(),
                weight_receiver=WeightReceiver(
                    configured=args.weight_transfer_config,
                    store_timeout_s=args.weight_transfer_timeout_s,
                    weight_dir=args.weight_dir,
                    sync_hosts=args.weight_sync_hosts,
                ),
            )
            config = Config()
            host = f"[{args.host}]" if ":" in args.host else args.host
            config.bind = [f"{host}:{args.port}"]
            config.graceful_timeout = GRACEFUL_TIMEOUT_S
            config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
            config.accesslog = None
            config.errorlog = logging.getLogger("hypercorn.error")  # one handler: ours
            if args.api_key is None and args.host not in LOCAL_HOSTS:
                log.warning(
                    "listening on %s without --api-key: anyone who can reach it can generate "
                    "(its control routes are closed)",
                    args.host,
                )
            async with trio.open_nursery() as server_nursery:
                binds = await server_nursery.start(
                    partial(hypercorn_serve, app, config, shutdown_trigger=shutdown.wait)
                )
                port = int(binds[0].rsplit(":", 1)[1])
                print(ready_line(host, port), flush=True)
            died = engine.died.is_set()
        nursery.cancel_scope.cancel()
    return died


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (exit 2) what would open the control plane beyond this machine without a key."""
    if args.allow_keyless_control and args.api_key is None and args.host not in LOCAL_HOSTS:
        parser.error(
            f"--allow-keyless-control on --host {args.host} would let anyone who reaches it "
            "change the weights: give --api-key (or VLLM_API_KEY), or bind 127.0.0.1"
        )


#: Addresses that only this machine reaches.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    # the log's first line: which process to signal (its group takes what it started along)
    pid_line = f"engines.local serve: pid {os.getpid()}, process group {os.getpgid(0)}"
    print(pid_line, file=sys.stderr, flush=True)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.exit_on_stdin_eof:  # from now on, the model's load included (after logging is set
        # up, so that its line reaches the log)
        threading.Thread(target=_exit_on_stdin_eof, name="stdin-eof", daemon=True).start()
    try:
        if trio.run(serve, args):
            return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a start-up failure: one clear line for the launcher's log tail
        log.exception("engine server failed")
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
