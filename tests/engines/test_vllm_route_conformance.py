"""Every request the trainer sends to a vLLM route is one vLLM 0.33.0's route accepts as meant.

The trainer's own client code (``InferenceClient``, the weight-sync bracket, the ``disk`` and
``gloo`` transports) drives the real reference server, through a recording proxy: a real
HTTP server in this process that records each request as it crosses the wire (method, path,
raw query string, JSON body) and the answer, and passes both through unchanged. Each
recorded request is then checked against ``reference/vllm_routes.json`` (vLLM 0.33.0's own
routers, dumped by ``reference/dump_vllm_routes.py``):

- the path and method are a vLLM route;
- every query parameter is one the route declares (or reads from the raw request, as
  ``/wake_up`` reads ``tags``), and its value, parsed as FastAPI parses a query string,
  validates against the declared schema; a required one is present;
- the body validates against the route's request-body schema (``jsonschema``), is JSON, has
  no top-level field the route does not declare (vLLM would drop it unread), and a route
  that takes no body gets none (an empty ``{}`` is read by nobody and allowed);
- the reference server's 200 answer has the keys and JSON types of the answer vLLM's router
  writes (and ``/v1/completions`` validates against the route's response schema).

The ``ipc`` transport needs CUDA; its bodies are built by the functions it sends and
checked the same way, without HTTP. ``InferenceClient.probe`` is left out on purpose: it
sends GET to POST routes to learn whether they exist (405 means present).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import attrs
import httpx
import jsonschema
import torch

from engines.client import LORA_ROUTES, ROUTE_FLAGS, InferenceClient
from engines.launch import EngineUrls
from engines.local.http import answer_lifespan
from engines.types import SamplingParams
from engines.weight_transfer import ipc_init_info, ipc_update_info, pickle_ipc_handles
from sync.bracket import Bracket
from sync.transports import DiskTransport
from sync.transports.broadcast import BroadcastTransport
from sync.weights import sync_weights
from tests.engines.helpers import auth, serve_asgi
from trainer.workers.local import LocalWorkerGroup

VLLM = json.loads((Path(__file__).parent / "vllm_recorded" / "vllm_routes.json").read_text())
OPENAPI = VLLM["openapi"]

#: Keys the reference server adds to vLLM's answer, each documented in docs/engines.md: a
#: client reading vLLM's keys never needs them.
REFERENCE_ONLY_KEYS: dict[str, frozenset[str]] = {
    # which half sleeps (vLLM answers one flag)
    "GET /is_sleeping": frozenset({"sleep_state"}),
    # one sha256 over every parameter (vLLM: per-parameter digests only), and loads so far
    "POST /weight_checker": frozenset({"checksum", "weight_version"}),
}

_BOOL_STRINGS = {
    **dict.fromkeys(("1", "true", "t", "yes", "y", "on"), True),
    **dict.fromkeys(("0", "false", "f", "no", "n", "off"), False),
}


@attrs.frozen
class Exchange:
    """One request as it crossed the wire, and the answer it got."""

    method: str
    path: str
    #: The raw query string, parsed (every value a string, repeated names kept).
    query: dict[str, list[str]]
    content_type: str | None
    #: The JSON body; None when empty.
    body: Any
    status: int
    #: The JSON answer; None when empty.
    answer: Any

    @property
    def route(self) -> str:
        return f"{self.method} {self.path}"


def _json_or_none(raw: bytes) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class RecordingProxy:
    """An ASGI app that forwards every request to ``upstream`` and records the exchange."""

    def __init__(self, upstream: str, http: httpx.AsyncClient) -> None:
        self.upstream = upstream
        self.http = http
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        query = scope["query_string"].decode("latin-1")
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        forwarded = {
            k: v for k, v in headers.items() if k not in ("host", "content-length", "connection")
        }
        response = await self.http.request(scope["method"], url, content=body, headers=forwarded)
        self.exchanges.append(
            Exchange(
                scope["method"],
                scope["path"],
                parse_qs(query, keep_blank_values=True),
                headers.get("content-type"),
                _json_or_none(body),
                response.status_code,
                _json_or_none(response.content),
            )
        )
        out_headers = [(b"content-type", response.headers.get("content-type", "").encode())]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": out_headers}
        )
        await send({"type": "http.response.body", "body": response.content})


@asynccontextmanager
async def recording_proxy(upstream: str) -> AsyncIterator[tuple[str, RecordingProxy]]:
    """A :class:`RecordingProxy` to ``upstream``, served for the block: ``(its URL, it)``."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as http:
        proxy = RecordingProxy(upstream, http)
        async with serve_asgi(proxy) as url:
            yield url, proxy


# -- the check ------------------------------------------------------------------------------------


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a top-level ``$ref`` followed (into the dump's components)."""
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        return OPENAPI["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return schema


def _validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator of ``schema`` that resolves ``#/components/...`` references in the dump."""
    return jsonschema.Draft202012Validator({**schema, "components": OPENAPI["components"]})


def _query_value(raw: str, schema: dict[str, Any]) -> Any:
    """``raw`` as FastAPI parses a query value of this schema (ints, floats, booleans)."""
    kinds = [s.get("type") for s in schema.get("anyOf", [schema])]
    if "integer" in kinds and raw.lstrip("+-").isdigit():
        return int(raw)
    if "boolean" in kinds and raw.lower() in _BOOL_STRINGS:
        return _BOOL_STRINGS[raw.lower()]
    if "number" in kinds:
        try:
            return float(raw)
        except ValueError:
            pass
    return raw


def _errors_of(route: str, what: str, validator: jsonschema.Draft202012Validator, value: Any):
    return [
        f"{route}: {what}{''.join(f'[{p!r}]' for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(value)
    ]


def request_errors(ex: Exchange) -> list[str]:
    """What in the request of ``ex`` vLLM 0.33.0's route does not take as sent."""
    route = ex.route
    operation = OPENAPI["paths"].get(ex.path, {}).get(ex.method.lower())
    if operation is None:
        return [f"{route}: vLLM 0.33.0 has no such route"]
    declared = {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "query"}
    raw_read = VLLM["raw_query_params"].get(route, {})
    errors = []
    for name, values in ex.query.items():
        if name in declared:
            schema = declared[name]["schema"]
            if len(values) > 1 and schema.get("type") != "array":
                errors.append(f"{route}: query parameter {name!r} sent {len(values)} times")
            errors += _errors_of(
                route,
                f"query parameter {name}={values[-1]!r}",
                _validator(schema),
                _query_value(values[-1], schema),
            )
        elif name in raw_read:
            if raw_read[name] == "get" and len(values) > 1:
                errors.append(f"{route}: query parameter {name!r} sent {len(values)} times")
        else:
            known = sorted({*declared, *raw_read})
            errors.append(
                f"{route}: query parameter {name!r} is not one vLLM declares (it takes {known})"
            )
    errors += [
        f"{route}: required query parameter {name!r} missing"
        for name, p in declared.items()
        if p.get("required") and name not in ex.query
    ]
    body_spec = operation.get("requestBody")
    if body_spec is None:
        if ex.body not in (None, {}):
            errors.append(f"{route}: vLLM's route takes no body, sent {ex.body!r:.100}")
        return errors
    if ex.body is None:
        if body_spec.get("required"):
            errors.append(f"{route}: the body is required")
        return errors
    if not (ex.content_type or "").startswith("application/json"):
        errors.append(f"{route}: content-type {ex.content_type!r}, not application/json")
    schema = body_spec["content"]["application/json"]["schema"]
    errors += _errors_of(route, "body", _validator(schema), ex.body)
    fields = _schema(schema).get("properties")
    if isinstance(ex.body, dict) and fields is not None:
        errors += [
            f"{route}: body field {k!r} is not one vLLM declares (vLLM drops it unread)"
            for k in ex.body
            if k not in fields
        ]
    return errors


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object"


def _fits(answer: Any, shape: dict[str, list[str]] | None, extra: frozenset[str]) -> bool:
    if shape is None:
        return answer is None
    if not isinstance(answer, dict) or set(answer) - extra != set(shape):
        return False
    return all(
        _json_type(answer[k]) in types or (_json_type(answer[k]) == "integer" and "number" in types)
        for k, types in shape.items()
    )


def answer_errors(ex: Exchange) -> list[str]:
    """How the reference server's 200 answer in ``ex`` differs from vLLM's router's."""
    if ex.status != 200:
        return [f"{ex.route}: answered {ex.status}: {ex.answer!r:.200}"]
    if ex.route == "POST /v1/completions":
        schema = OPENAPI["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
        validator = _validator(schema["application/json"]["schema"])
        return _errors_of(ex.route, "answer", validator, ex.answer)
    shapes = VLLM["responses"].get(ex.route)
    if shapes is None:
        return []
    extra = REFERENCE_ONLY_KEYS.get(ex.route, frozenset())
    if any(_fits(ex.answer, shape, extra) for shape in shapes):
        return []
    return [f"{ex.route}: answered {ex.answer!r:.200}; vLLM answers one of {shapes}"]


def conformance_errors(exchanges: list[Exchange]) -> list[str]:
    return [e for ex in exchanges for e in (*request_errors(ex), *answer_errors(ex))]


def assert_conforms(exchanges: list[Exchange]) -> None:
    """Every request and answer in ``exchanges`` conforms; else one line per disagreement."""
    errors = conformance_errors(exchanges)
    assert not errors, "disagreements with vLLM 0.33.0:\n" + "\n".join(errors)


def routes_of(exchanges: list[Exchange]) -> set[str]:
    return {ex.route for ex in exchanges}


def sent(method: str, path: str, body: Any = None, **query: str) -> Exchange:
    """A request built here, not sent (for bodies that cannot travel on this machine)."""
    ctype = "application/json" if body is not None else None
    return Exchange(method, path, {k: [v] for k, v in query.items()}, ctype, body, 200, None)


# -- the trainer's requests -----------------------------------------------------------------------


async def test_generate_and_generate_n_send_vllms_completion_request(engine_urls: EngineUrls):
    async with httpx.AsyncClient(headers=auth(engine_urls)) as http:
        model = (await http.get(f"{engine_urls[0]}/v1/models")).json()["data"][0]["id"]
    async with recording_proxy(engine_urls[0]) as (url, proxy):
        async with InferenceClient([url], api_key=engine_urls.api_key) as client:
            await client.generate([5, 6, 7], SamplingParams(max_tokens=3, seed=1))
        async with InferenceClient([url], api_key=engine_urls.api_key, model=model) as client:
            sampling = SamplingParams(
                temperature=0.7, top_p=0.9, max_tokens=4, seed=2, stop_token_ids=(3,), stop=("x",)
            )
            await client.generate_n([5, 6, 7], sampling, 3)
            await client.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [ex.route for ex in proxy.exchanges] == ["POST /v1/completions"] * 3
    assert proxy.exchanges[1].body["n"] == 3 and proxy.exchanges[1].body["stop"] == ["x"]
    assert_conforms(proxy.exchanges)


async def test_every_control_call_sends_what_vllms_routes_declare(engine_urls: EngineUrls):
    async with recording_proxy(engine_urls[0]) as (url, proxy):
        async with InferenceClient([url], api_key=engine_urls.api_key) as client:
            for mode in ("keep", "abort", "wait"):
                await client.pause(mode)
                assert await client.is_paused() == [True]
                await client.resume()
            assert await client.get_world_size() == [1]
            assert len(await client.weight_checksums()) == 1
            await client.reset_prefix_cache()
            for level, mode in ((1, None), (1, "keep"), (2, "wait"), (1, "abort")):
                await client.sleep(level, mode)
                assert await client.is_sleeping() == [True]
                await client.wake_up(["weights"])
                await client.wake_up(["kv_cache"])
                assert await client.is_sleeping() == [False]
            await client.sleep(1)
            await client.wake_up(["weights", "kv_cache"])
            await client.sleep(1)
            await client.wake_up()
            assert await client.is_sleeping() == [False]
    assert routes_of(proxy.exchanges) == {
        "POST /pause",
        "GET /is_paused",
        "POST /resume",
        "GET /get_world_size",
        "POST /weight_checker",
        "POST /reset_prefix_cache",
        "POST /sleep",
        "GET /is_sleeping",
        "POST /wake_up",
    }
    modes = [ex.query.get("mode") for ex in proxy.exchanges if ex.path in ("/pause", "/sleep")]
    assert modes == [["keep"], ["abort"], ["wait"], None, ["keep"], ["wait"], ["abort"], None, None]
    tags = [ex.query.get("tags") for ex in proxy.exchanges if ex.path == "/wake_up"]
    assert tags == [["weights"], ["kv_cache"]] * 4 + [["weights", "kv_cache"], None]
    assert_conforms(proxy.exchanges)


async def test_the_disk_and_gloo_syncs_send_what_vllms_routes_declare(
    engine_urls: EngineUrls, model_dir: Path, tmp_path: Path
):
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    async with recording_proxy(engine_urls[0]) as (url, proxy):
        async with InferenceClient([url], api_key=engine_urls.api_key) as client:
            disk = DiskTransport(tmp_path / "sync", bucket_bytes=64 * 1024)
            await disk.init(client, workers)
            # the offloading bracket: pause, sleep, wake the weights, transfer, wake the KV cache
            await sync_weights(
                client, workers, disk, bracket=Bracket.PAUSE_OFFLOAD_KV, pause_mode="wait"
            )
            gloo = BroadcastTransport(64 * 1024, group_init_timeout_s=120)
            await gloo.init(client, workers)
            await sync_weights(client, workers, gloo)
            await gloo.close(workers)
            assert await client.weight_checksums() != []
    routes = [ex.route for ex in proxy.exchanges]
    assert routes.count("POST /init_weight_transfer_engine") == 2
    assert routes.count("POST /finish_weight_update") == 2
    # a small bucket size: several disk calls; one packed gloo call for the whole model
    assert routes.count("POST /update_weights") > 2
    assert {"POST /pause", "POST /sleep", "POST /wake_up", "POST /resume"} <= set(routes)
    assert_conforms(proxy.exchanges)


def test_the_ipc_bodies_fit_vllms_weight_transfer_routes():
    bucket = [("a.weight", torch.zeros(2, 3)), ("b.bias", torch.zeros(4, dtype=torch.bfloat16))]
    handle = pickle_ipc_handles({"GPU-uuid": (1, "handle", 2)})
    requests = [
        sent("POST", "/init_weight_transfer_engine", {"init_info": ipc_init_info(True)}),
        sent("POST", "/start_weight_update", {}),
        sent("POST", "/update_weights", {"update_info": ipc_update_info(bucket, [24, 8], handle)}),
        sent("POST", "/finish_weight_update", {}),
    ]
    assert [e for r in requests for e in request_errors(r)] == []


def test_a_planted_query_parameter_or_body_field_is_named():
    """The check can fail, naming the route and the field."""
    assert request_errors(sent("POST", "/pause", mode="keep", wait_for_inflight_requests="1")) == [
        "POST /pause: query parameter 'wait_for_inflight_requests' is not one vLLM declares "
        "(it takes ['clear_cache', 'mode'])"
    ]
    assert request_errors(sent("POST", "/sleep", level="3", mode="hold")) == [
        "POST /sleep: query parameter level='3': 3 is greater than the maximum of 2",
        "POST /sleep: query parameter mode='hold': 'hold' is not one of ['abort', 'wait', 'keep']",
    ]
    body = {"init_info": {"packed": True}, "backend": "gloo"}
    assert request_errors(sent("POST", "/init_weight_transfer_engine", body)) == [
        "POST /init_weight_transfer_engine: body field 'backend' is not one vLLM declares "
        "(vLLM drops it unread)"
    ]
    assert request_errors(sent("POST", "/update_weights", {"update_info": "names"})) == [
        "POST /update_weights: body['update_info']: 'names' is not valid under any of the "
        "given schemas"
    ]
    assert request_errors(sent("POST", "/start_weight_update", {"version": 1})) == [
        "POST /start_weight_update: vLLM's route takes no body, sent {'version': 1}"
    ]
    assert request_errors(sent("POST", "/pause_generation")) == [
        "POST /pause_generation: vLLM 0.33.0 has no such route"
    ]
    bad = Exchange("POST", "/reset_prefix_cache", {}, None, None, 200, None)
    assert answer_errors(bad) == [
        "POST /reset_prefix_cache: answered None; vLLM answers one of [{'success': ['boolean']}]"
    ]


def test_the_dump_is_vllm_0_33_0_and_has_every_route_the_client_knows():
    """The LoRA routes aside: vLLM attaches them to its app only at start-up with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (``attach_router``), not on the module router the dump
    reads; their bodies and answers were probed on vLLM's CPU build instead
    (``tests/engines/local/test_lora_serving.py``) and run against it in the tier."""
    assert VLLM["vllm_version"] == "0.33.0"
    missing = [
        f"{method} {path}"
        for path, (method, _) in ROUTE_FLAGS.items()
        if method.lower() not in OPENAPI["paths"].get(path, {}) and path not in LORA_ROUTES
    ]
    assert missing == []
    assert VLLM["raw_query_params"] == {"POST /wake_up": {"tags": "getlist"}}
