"""Inside a Ray actor, on the node Ray picked: start one server process, report on it, stop it.

Blocking code on purpose: it runs in the actor's own threads (a threaded actor, so that
``port``, ``exit_status`` and ``log_tail`` answer while the trainer waits for the server),
never on the trainer's trio thread. The trainer waits for the server as it waits for its own
processes (:func:`~engines.launch._ready.wait_all_ready`), asking this actor through
:class:`~engines.launch._ray.RayEngine`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, cast

from engines.launch._ready import READY_SEARCH_CHARS, exit_text, ready_port
from engines.launch._spec import LOG_TAIL_CHARS, ServersSpec, popen_kwargs, server_env
from engines.launch._stop import stop_group_blocking
from trainer.errors import EngineStartError

__all__ = ["EngineServerActor"]


class EngineServerActor:
    """Starts one server process on this node and stops it on request."""

    def __init__(
        self,
        index: int,
        log_dir: str,
        servers: ServersSpec,
        api_key: str | None,
        weight_dir: str | None = None,
        weight_sync_hosts: tuple[str, ...] = (),
    ) -> None:
        self.name = f"engine-{index}"
        self._index = index
        self._log_path = self._choose_log_path(Path(log_dir) / f"{self.name}.log")
        self._servers = servers
        self._api_key = api_key
        #: ``TRAINER_WEIGHT_DIR`` and ``TRAINER_WEIGHT_SYNC_HOSTS`` of its server (server_env).
        self._weight_dir = weight_dir
        self._weight_sync_hosts = weight_sync_hosts
        self._proc: subprocess.Popen[bytes] | None = None
        self._told_port: int | None = None
        self._log_offset = 0
        self._lock = threading.Lock()
        #: Set by ``stop``: a ``start`` that has not launched the server yet never will.
        self._stopping = False

    @staticmethod
    def _choose_log_path(wanted: Path) -> Path:
        """``wanted`` when its directory can be made on this node, else a temp directory."""
        try:
            wanted.parent.mkdir(parents=True, exist_ok=True)
            return wanted
        except OSError:
            fallback = Path(tempfile.gettempdir()) / "trainer-engines" / wanted.name
            fallback.parent.mkdir(parents=True, exist_ok=True)
            return fallback

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """What this run's server wrote to its log, the last ``chars`` characters."""
        try:
            data = self._log_path.read_bytes()
        except OSError:
            return ""
        return data[self._log_offset :].decode(errors="replace")[-chars:]

    def start(self) -> dict[str, Any]:
        """Start the server (not waited for); its pids, node, log path and told port."""
        import ray  # heavy: imported only where Ray places engines

        host = ray.util.get_node_ip_address()
        spec = self._servers(self._index, host)
        with self._lock, open(self._log_path, "ab") as log_file:
            if self._stopping:
                raise EngineStartError(f"{self.name} on {host}", "stopped during start-up")
            self._log_offset = log_file.seek(0, 2)
            env = server_env(
                None,
                self._api_key,
                weight_dir=self._weight_dir,
                weight_sync_hosts=self._weight_sync_hosts,
            )
            # no text mode among the kwargs: a bytes process (typeshed cannot see that in **)
            proc = cast(
                "subprocess.Popen[bytes]",
                subprocess.Popen(list(spec.argv), **popen_kwargs(spec, log_file, env)),
            )
            self._proc, self._told_port = proc, spec.port
        return {
            "pid": proc.pid,
            "actor_pid": os.getpid(),
            "node_ip": host,
            "log_path": str(self._log_path),
        }

    def port(self) -> int | None:
        """The port the server listens on (told, or from its ready line); None: not yet."""
        if self._told_port is not None:
            return self._told_port
        return ready_port(self.log_tail(READY_SEARCH_CHARS))

    def exit_status(self) -> str | None:
        """How the server ended ("exit code N", "signal N"); None while it runs (or before)."""
        return None if self._proc is None else exit_text(self._proc.poll())

    def stop(self, timeout_s: float) -> int | None:
        """Close stdin, SIGTERM the server's group, SIGKILL it after ``timeout_s``; its code."""
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is None:
            return None
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass

        def exited(wait_s: float) -> bool:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                return False
            return True

        stop_group_blocking(proc.pid, timeout_s, exited)
        return proc.returncode
