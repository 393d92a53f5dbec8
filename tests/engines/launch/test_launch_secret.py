"""What ties a started server to its run: a fresh secret per launch (or the caller's), its
weight folder and weight-sync hosts, all in its environment, none on its command line or in
its log; the client the launcher's caller makes gets in with it, no one else does."""

from __future__ import annotations

from pathlib import Path

import httpx

from engines.client import InferenceClient
from engines.launch import ReferenceServers, new_api_key, open_engine_processes

STARTUP_S = 180.0


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(v.decode(errors="replace").partition("=")[::2] for v in raw if b"=" in v)


async def test_each_launch_gives_its_servers_a_fresh_secret_by_environment_alone(
    model_dir: Path, tmp_path: Path
) -> None:
    async with open_engine_processes(
        1,
        ReferenceServers(str(model_dir)),
        tmp_path / "logs",
        startup_timeout_s=STARTUP_S,
        weight_dir=tmp_path / "weight_sync",
        weight_sync_hosts=("127.0.0.1", "10.1.2.3"),
    ) as engines:
        (engine,) = engines
        secret = engines.api_key
        assert len(secret) >= 40  # 256 random bits
        env = environ(engine.pid)
        assert env["VLLM_API_KEY"] == secret
        assert env["TRAINER_WEIGHT_DIR"] == str((tmp_path / "weight_sync").resolve())
        assert env["TRAINER_WEIGHT_SYNC_HOSTS"] == "127.0.0.1,10.1.2.3"
        # /proc/PID/cmdline is every user's to read; environ is the owner's alone
        assert secret.encode() not in cmdline(engine.pid)
        async with httpx.AsyncClient(base_url=engine.url) as http:
            assert (await http.get("/v1/models")).status_code == 401
        async with InferenceClient([engine.url], api_key=secret) as client:
            await client.probe()
    assert secret not in (tmp_path / "logs" / "engine-0.log").read_text()
    given = new_api_key()
    assert given != secret
    async with open_engine_processes(
        1,
        ReferenceServers(str(model_dir)),
        tmp_path / "logs",
        api_key=given,
        startup_timeout_s=STARTUP_S,
    ) as engines:
        assert engines.api_key == given
        assert environ(engines[0].pid)["VLLM_API_KEY"] == given
