"""The reference server answers only its run, and only what it can take (issue 60, findings 1, 7).

One real server process for the module (``python -m engines.local serve``, as a launcher starts
it): its API key in ``VLLM_API_KEY``, its weight folder in ``TRAINER_WEIGHT_DIR``, LoRA and
sleep mode on. Each test talks to it over HTTP, as a stranger on the host would:

- without the key every route but ``GET /health`` is a 401, the weight-transfer ones included;
- a keyless server serves the data plane and closes the rest (403, saying how to open it);
- a ``disk`` update reads only regular files under the weight folder, and says nothing of
  files elsewhere; a ``master_address`` outside the weight-sync hosts is refused before any
  connection;
- a completion sent while an update is open waits for its finish (the server lives on);
- malformed bodies of every route are 4xx, and the server serves on afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from engines.local.__main__ import main as serve_main
from engines.local.server import KEYLESS_CLOSED, KEYLESS_PATHS, ROUTES, UNAUTHORIZED
from engines.local.weight_routes import WEIGHT_TRANSFER_PATHS
from engines.lora_answers import MAX_ADAPTER_CONFIG_BYTES
from tests.engines.helpers import STARTUP_TIMEOUT_S, serve_reference

PROJECT = Path(__file__).resolve().parents[3]
KEY = "the-runs-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
DISK = {"backend": "disk"}


class Guarded:
    """The module's server: its URL and its weight folder."""

    def __init__(self, url: str, weight_dir: Path, log: Path) -> None:
        self.url = url
        self.weight_dir = weight_dir
        self.log = log

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """A client that sends the key."""
        return httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    root = tmp_path_factory.mktemp("guarded")
    weight_dir = root / "weight_sync"
    weight_dir.mkdir()
    log = root / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(PROJECT),
        "VLLM_API_KEY": KEY,
        "TRAINER_WEIGHT_DIR": str(weight_dir),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    }
    env.pop("TRAINER_WEIGHT_SYNC_HOSTS", None)
    cmd = [sys.executable, "-m", "engines.local", "serve", "--model", str(model_dir)]
    cmd += ["--port", "0", "--enable-lora", "--enable-sleep-mode", "--exit-on-stdin-eof"]
    with log.open("wb") as err:
        server = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
        )
    try:
        assert server.stdout is not None
        line = server.stdout.readline().decode()  # the ready line, or "" if it died
        assert line.startswith("ENGINE_READY"), f"no ready line: {log.read_text()[-2000:]}"
        yield Guarded(line.split("url=", 1)[1].strip(), weight_dir, log)
    finally:
        assert server.stdin is not None
        server.stdin.close()  # --exit-on-stdin-eof
        try:
            server.wait(timeout=STARTUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


def every_route() -> list[tuple[str, str]]:
    """(method, path) of every route the server has, the weight-transfer ones, and one it
    has not."""
    routes = [(m, path) for path, methods in ROUTES.items() for m in methods]
    routes += [("POST", path) for path in WEIGHT_TRANSFER_PATHS]
    return [*routes, ("GET", "/no/such/route"), ("POST", "/v1/no_such_route")]


async def mend(g: Guarded, model_dir: Path) -> None:
    """One complete disk update (start, a bucket, finish): the weights whole again after a
    refused update (vLLM's session closes on any failed update and leaves them partial; a
    decode step then would end the engine, as vLLM's worker ends)."""
    info = _bucket(model_dir, g.weight_dir / "mend.safetensors")
    info["path"] = str(g.weight_dir / "mend.safetensors")
    async with g.client() as http:
        assert (
            await http.post("/init_weight_transfer_engine", json={"init_info": DISK})
        ).status_code == 200
        await http.post("/finish_weight_update", json={})  # close one left open, if any
        assert (await http.post("/start_weight_update", json={})).status_code == 200
        r = await http.post("/update_weights", json={"update_info": info})
        assert r.status_code == 200, r.text
        assert (await http.post("/finish_weight_update", json={})).status_code == 200


async def alive(g: Guarded) -> None:
    """The server answers its probe and generates, with the key."""
    async with g.client() as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200, r.text


# -- who may call -----------------------------------------------------------------------------


async def test_without_the_key_every_route_but_health_is_a_401(guarded: Guarded) -> None:
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"X-Api-Key": KEY}]
    async with httpx.AsyncClient(base_url=guarded.url, timeout=60) as http:
        for method, path in every_route():
            for headers in wrong:
                body = b"{" * 100 if method == "POST" else None  # not even read
                r = await http.request(method, path, headers=headers, content=body)
                if path == "/health":
                    assert r.status_code == 200, (method, path, headers)
                else:
                    assert r.status_code == 401, (method, path, headers, r.text)
                    assert r.json()["error"]["message"] == UNAUTHORIZED
    async with guarded.client() as http:  # with it, each is answered (weights untouched)
        assert (await http.get("/engine_stats")).status_code == 200
        assert (await http.get("/control_log")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
        lower = {"Authorization": f"bearer {KEY}"}  # the scheme in any case, as vLLM
        assert (await http.get("/is_paused", headers=lower)).status_code == 200
    await alive(guarded)


async def test_a_keyless_server_serves_the_data_plane_and_closes_the_rest(model_dir) -> None:
    async with (
        serve_reference(model_dir, control_without_key=False, lora_routes=True) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        for method, path in every_route():
            r = await http.request(method, path, json={})
            if path in KEYLESS_PATHS:
                assert r.status_code in (200, 400), (method, path, r.text)
            elif path.startswith(("/no", "/v1/no")):
                assert r.status_code == 404
            else:
                assert r.status_code == 403, (method, path, r.text)
                assert r.json()["error"]["message"] == KEYLESS_CLOSED
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200


def test_serve_refuses_a_keyless_control_plane_beyond_loopback(capsys) -> None:
    env_key = os.environ.pop("VLLM_API_KEY", None)
    try:
        with pytest.raises(SystemExit) as exit_:
            serve_main(["serve", "--allow-keyless-control", "--host", "0.0.0.0"])
    finally:
        if env_key is not None:
            os.environ["VLLM_API_KEY"] = env_key
    assert exit_.value.code == 2
    assert "--allow-keyless-control on --host 0.0.0.0" in capsys.readouterr().err


# -- what a weight update may name --------------------------------------------------------------


def _bucket(model_dir: Path, path: Path) -> dict[str, Any]:
    """Write one parameter of the served model to ``path``; its ``update_info``."""
    name = "model.layers.0.input_layernorm.weight"
    tensor = load_file(str(model_dir / "model.safetensors"))[name]
    save_file({name: tensor}, str(path))
    return {"names": [name], "dtype_names": ["float32"], "shapes": [list(tensor.shape)]}


async def test_a_disk_update_reads_only_regular_files_under_the_weight_dir(
    guarded: Guarded, model_dir: Path, tmp_path: Path
) -> None:
    inside = guarded.weight_dir / "v1"
    inside.mkdir()
    info = _bucket(model_dir, inside / "bucket_0.safetensors")
    outside = tmp_path / "elsewhere.safetensors"
    _bucket(model_dir, outside)
    (inside / "link.safetensors").symlink_to(outside)
    (inside / "inner-link.safetensors").symlink_to(inside / "bucket_0.safetensors")
    (guarded.weight_dir / "escape").symlink_to(tmp_path, target_is_directory=True)
    os.mkfifo(inside / "fifo.safetensors")
    refused = {
        "/etc/shadow": 403,  # exists, unreadable
        "/etc/hostname": 403,  # exists, readable, not safetensors
        str(tmp_path / "no-such-file"): 403,  # does not exist
        str(outside): 403,  # a real bucket, elsewhere
        f"{guarded.weight_dir}/v1/../../{tmp_path.name}/elsewhere.safetensors": 403,
        str(guarded.weight_dir / "escape" / "elsewhere.safetensors"): 403,  # a linked folder
        str(inside / "link.safetensors"): 403,
        str(inside / "inner-link.safetensors"): 403,  # no link is followed, even inside
        str(inside / "fifo.safetensors"): 403,  # not a regular file (and the open did not block)
        str(inside): 403,  # a folder
        "bucket_0.safetensors": 403,  # relative
        str(inside / "missing.safetensors"): 500,  # inside: vLLM's failed call, named
    }
    async with guarded.client() as http:
        init = {"init_info": DISK}
        assert (await http.post("/init_weight_transfer_engine", json=init)).status_code == 200
        outside_messages = set()
        for path, status in refused.items():
            assert (await http.post("/start_weight_update", json={})).status_code == 200
            r = await http.post("/update_weights", json={"update_info": {**info, "path": path}})
            assert r.status_code == status, (path, r.text)
            if status == 403 and not path.startswith(str(guarded.weight_dir)):
                outside_messages.add(r.json()["error"]["message"])
            assert "header" not in r.text and "Permission" not in r.text
        # one sentence for every path outside, whether it exists or not
        assert outside_messages == {
            "update_info.path must name a file under this server's weight folder "
            "(--weight-dir (or TRAINER_WEIGHT_DIR))"
        }
        assert (await http.post("/start_weight_update", json={})).status_code == 200
        good = {**info, "path": str(inside / "bucket_0.safetensors")}
        r = await http.post("/update_weights", json={"update_info": good})
        assert r.status_code == 200, r.text
        assert (await http.post("/finish_weight_update", json={})).status_code == 200
    await alive(guarded)


async def test_disk_updates_are_refused_without_a_weight_dir_saying_how(model_dir) -> None:
    async with serve_reference(model_dir) as url, httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/init_weight_transfer_engine", json={"init_info": DISK})
    assert r.status_code == 400
    assert "disk weight updates are off: start the server with --weight-dir" in r.text


async def test_a_master_address_outside_the_sync_hosts_is_refused_before_connecting(
    guarded: Guarded,
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))  # loopback, but not one of the hosts by name
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    init = {"master_address": "127.0.0.2", "master_port": port, "rank_offset": 1, "world_size": 2}
    try:
        async with guarded.client() as http:
            for address in ("127.0.0.2", "10.0.0.1", "example.com", "0.0.0.0"):
                body = {"init_info": {**init, "master_address": address}}
                r = await http.post("/init_weight_transfer_engine", json=body)
                assert r.status_code == 400, r.text
                assert "--weight-sync-hosts" in r.text and "TRAINER_WEIGHT_SYNC_HOSTS" in r.text
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
    await alive(guarded)


# -- no crash, no 5xx -------------------------------------------------------------------------


async def test_a_completion_sent_while_an_update_is_open_waits_for_its_finish(
    guarded: Guarded,
) -> None:
    async with guarded.client() as http:
        init = {"init_info": DISK}
        assert (await http.post("/init_weight_transfer_engine", json=init)).status_code == 200
        assert (await http.post("/start_weight_update", json={})).status_code == 200
        answers: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def complete() -> None:
                body = {"prompt": [5, 6, 7], "max_tokens": 3}
                answers.append(await http.post("/v1/completions", json=body))

            nursery.start_soon(complete)
            while True:  # seen by the engine, held there
                stats = (await http.get("/engine_stats")).json()
                if stats["num_requests_running"] + stats["num_requests_waiting"] == 1:
                    break
                await trio.sleep(0.05)
            assert not answers
            assert (await http.get("/health")).status_code == 200  # alive, not dead
            assert (await http.post("/finish_weight_update", json={})).status_code == 200
        assert answers[0].status_code == 200
        assert len(answers[0].json()["choices"][0]["text"]) >= 0
    assert "the engine died" not in guarded.log.read_text()
    await alive(guarded)


async def test_a_lone_surrogate_is_a_400_in_every_text_field(guarded: Guarded) -> None:
    bodies = {
        "/v1/completions": [{"prompt": "\ud800"}, {"prompt": ["ok", "\udfff"]}],
        "/v1/chat/completions": [
            {"messages": [{"role": "user", "content": "\ud800"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
        ],
        "/v1/load_lora_adapter": [{"lora_name": "\ud800", "lora_path": "/x"}],
    }
    async with guarded.client() as http:
        for path, cases in bodies.items():
            for body in cases:
                raw = json.dumps(body)  # ensure_ascii: "\\ud800", as a client sends it
                r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, body, r.text)
                assert "lone UTF-16 surrogate" in r.text
        pair = {"prompt": "\U0001f600", "max_tokens": 1}  # a valid pair is text
        assert (await http.post("/v1/completions", json=pair)).status_code == 200
    await alive(guarded)


def _adapter(root: Path, name: str, config: bytes) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes(config)
    save_file({"x": torch.zeros(1)}, str(folder / "adapter_model.safetensors"))
    return folder


async def test_an_adapter_config_it_cannot_take_is_a_400_in_vllms_frame(
    guarded: Guarded, tmp_path: Path
) -> None:
    def config(**fields: Any) -> bytes:
        return json.dumps({"lora_alpha": 16, **fields}).encode()

    cases = {
        "r0": (config(r=0), "LoRA rank `r` must be a positive integer, got 0."),
        "negative": (config(r=-4), "LoRA rank `r` must be a positive integer, got -4."),
        "text": (config(r="4"), "LoRA rank `r` must be a positive integer, got '4'."),
        "no-rank": (config(), "Missing required configuration fields: ['r']"),
        "alpha": (config(r=4, lora_alpha="x"), "lora_alpha must be a finite number"),
        "not-json": (b"{r: 4", "adapter_config.json is not valid JSON"),
        "a-list": (b"[4]", "adapter_config.json is not a JSON object"),
        "huge": (
            b'{"r": 4, "pad": "' + b"x" * MAX_ADAPTER_CONFIG_BYTES + b'"}',
            f"over the {MAX_ADAPTER_CONFIG_BYTES} bytes a load reads",
        ),
    }
    async with guarded.client() as http:
        for name, (raw, words) in cases.items():
            path = _adapter(tmp_path, name, raw)
            body = {"lora_name": name, "lora_path": str(path)}
            r = await http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400, (name, r.text)
            message = r.json()["error"]["message"]
            assert message.startswith("Call to add_lora method failed: Worker failed with error")
            assert words in message, (name, message)
    await alive(guarded)


async def test_a_wrongly_shaped_update_info_is_a_400(guarded: Guarded, model_dir: Path) -> None:
    bad = [
        {"names": "x", "dtype_names": [], "shapes": []},
        {
            "names": [["not", "a", "name"]],
            "dtype_names": ["float32"],
            "shapes": [[1]],
            "path": "/x",
        },
        {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [5], "path": "/x"},
        {"names": ["lm_head.weight"], "dtype_names": ["nope"], "shapes": [[56, 64]], "path": "/x"},
        {"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]], "path": "/x"},
        {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[56, 64]]},
    ]
    async with guarded.client() as http:
        init = {"init_info": DISK}
        assert (await http.post("/init_weight_transfer_engine", json=init)).status_code == 200
        for info in bad:
            assert (await http.post("/start_weight_update", json={})).status_code == 200
            r = await http.post("/update_weights", json={"update_info": info})
            assert r.status_code == 400, (info, r.text)
            assert "Call to collective_rpc" not in r.text  # not re-framed as a failed call
    await mend(guarded, model_dir)
    await alive(guarded)


#: Values no field expects: wrong types, huge and negative numbers, deep and nested junk.
JUNK: list[str] = [
    "null",
    "true",
    "-1",
    "0",
    "1e400",
    "-1e400",
    str(10**40),
    "1.5",
    '""',
    json.dumps("x" * 5000),
    "[]",
    "[[[[[]]]]]",
    "{}",
    '{"a": {"b": [1, {"c": null}]}}',
    "[" * 5000 + "]" * 5000,
    '"\\ud800"',
    "NaN",
]

#: The fields each route reads (a field at a time is replaced by junk).
FIELDS: dict[str, list[str]] = {
    "/v1/completions": [
        "prompt",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "seed",
        "logprobs",
        "stop",
        "stop_token_ids",
        "model",
        "stream",
        "return_token_ids",
        "ignore_eos",
    ],
    "/v1/chat/completions": ["messages", "max_tokens", "n", "logprobs", "top_logprobs", "model"],
    "/inference/v1/generate": ["token_ids", "sampling_params", "model", "stream"],
    "/v1/load_lora_adapter": ["lora_name", "lora_path", "load_inplace"],
    "/v1/unload_lora_adapter": ["lora_name"],
    "/weight_checker": ["action", "baseline"],
    "/init_weight_transfer_engine": ["init_info"],
    "/update_weights": ["update_info"],
    "/finish_weight_update": ["weight_version"],
}

#: A valid body each field's junk goes into (a junk master_address is no host it may name).
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": [5, 6], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/inference/v1/generate": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
    "/weight_checker": {"action": "checksum"},
}

#: Nested fields: junk in each of an init_info's and an update_info's fields.
INNER: dict[str, tuple[str, dict[str, Any]]] = {
    "/init_weight_transfer_engine": (
        "init_info",
        {"master_address": "10.9.9.9", "master_port": 1, "rank_offset": 1, "world_size": 2},
    ),
    "/update_weights": (
        "update_info",
        {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[56, 64]]},
    ),
}

QUERIES = [
    "/pause?mode=nope",
    "/pause?mode=",
    "/sleep?level=1e400",
    "/sleep?level=-1",
    "/sleep?level=1&mode=nope",
    "/wake_up?tags=nope",
    "/reset_prefix_cache?reset_running_requests=maybe",
]


def fuzz_bodies() -> Iterator[tuple[str, str]]:
    """(path, raw JSON body): every route given junk whole, and each field of it junk."""
    for method, path in every_route():
        if method != "POST":
            continue
        for junk in JUNK:
            yield path, junk
        base = BASES.get(path, {})
        for field in FIELDS.get(path, []):
            for junk in JUNK:
                rest = json.dumps({k: v for k, v in base.items() if k != field})
                yield path, rest[:-1] + ("," if len(rest) > 2 else "") + f'"{field}": {junk}}}'
        if path in INNER:
            outer, inner = INNER[path]
            for field in inner:
                for junk in JUNK:
                    rest = json.dumps({k: v for k, v in inner.items() if k != field})
                    body = rest[:-1] + ("," if len(rest) > 2 else "") + f'"{field}": {junk}}}'
                    yield path, f'{{"{outer}": {body}}}'


async def test_junk_in_every_field_of_every_route_is_never_a_5xx(
    guarded: Guarded, model_dir: Path
) -> None:
    """Each route's body whole and field by field replaced by junk (and bad query values):
    never a 5xx but the weight routes' failed calls in vLLM's frame, and the server serves on."""
    json_header = {"content-type": "application/json"}
    five_hundreds = []
    async with guarded.client() as http:
        init = {"init_info": DISK}
        assert (await http.post("/init_weight_transfer_engine", json=init)).status_code == 200
        for path, raw in fuzz_bodies():
            if path in ("/update_weights", "/finish_weight_update"):  # an update to refuse in
                await http.post("/start_weight_update", json={})
            r = await http.post(path, content=raw, headers=json_header)
            if r.status_code >= 500 and "Call to collective_rpc" not in r.text:
                five_hundreds.append((path, raw[:80], r.status_code, r.text[:200]))
        for query in QUERIES:
            r = await http.post(query)
            assert r.status_code < 500, (query, r.text)
        await http.post("/finish_weight_update", json={})
        await http.post("/wake_up")
        await http.post("/resume")
        await http.post("/weight_checker", json={"action": "checksum"})
    assert not five_hundreds, five_hundreds
    assert "Traceback" not in guarded.log.read_text()
    await mend(guarded, model_dir)
    await alive(guarded)
