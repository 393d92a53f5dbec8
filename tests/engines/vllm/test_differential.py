"""The same requests to real vLLM and to the reference server; what the trainer reads must agree.

Both serve the built-in tiny model (float32, seed 0, the ``disk`` weight-transfer backend, no
sleep mode), started as docs/vllm.md and docs/engines.md tell a user to start them. One script
of steps runs against each, in order: the data plane (greedy tokens and logprobs, top
logprobs, seeds and ``n`` through the trainer's own client, stop reasons, the token-in route
``/inference/v1/generate`` that verifiers' training client calls), pause and resume (a
request sent while paused waits, then completes), ``/weight_checker``, the weight-transfer
session (out-of-turn calls, a second start, a tensor sent twice, a failed update, a complete
update whose weights both then serve exactly), sleep, and last the engine broken by a failed
update and resumed: both answer the next completion with vLLM's ``EngineDeadError`` and exit.

Each step records what the trainer reads of the answer (status, error frame, fields, numbers
within 1e-4). The steps whose records differ must be exactly the rows of the table "Where the
reference engine differs from vLLM" in docs/engines.md: a new difference fails this test, and
so does a row that no longer differs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import torch
import trio
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engines.client import InferenceClient
from engines.launch import EngineUrls
from engines.local.requests import ENGINE_DEAD_MESSAGE
from engines.models import build_tiny_model
from engines.types import SamplingParams
from tests.engines.helpers import BackgroundEngines, bearer
from tests.engines.vllm.servers import PROJECT, RealServer
from tests.sync.exactness import PROMPT, policy_logprobs

pytestmark = pytest.mark.vllm

DOC = PROJECT / "docs" / "engines.md"
TABLE_START = "<!-- differences: kept true by tests/engines/vllm/test_differential.py -->"
#: vLLM's frame around an error raised in its worker by a weight route.
FRAME = re.compile(r"^Call to collective_rpc method failed: Worker failed with error '(.*)', ")
TOLERANCE = 1e-4


@pytest.fixture
def vllm_disk(fresh_vllm_disk_server: RealServer) -> RealServer:
    """A server of this test's own, not the tier's shared ``disk`` one: the script compares
    vLLM as started (the served weights, which the tier's other tests move, and no transfer
    engine yet) with the reference as started, and ends it (it exits)."""
    return fresh_vllm_disk_server


@pytest.fixture(scope="module")
def reference_disk(tmp_path_factory) -> Iterator[EngineUrls]:
    """The reference server as the launcher starts it: its own key, disk updates from under
    the session's temporary folder (where the script writes its buckets)."""
    engines = BackgroundEngines(
        1,
        build_tiny_model(),
        tmp_path_factory.mktemp("reference-logs"),
        extra_args=("--weight-transfer-config", '{"backend": "disk"}'),
        weight_dir=tmp_path_factory.getbasetemp(),
    ).start()
    try:
        yield engines.urls
    finally:
        engines.stop()


@attrs.define
class Fixtures:
    """What the steps share: the model, its weights (as served, and moved), bucket files."""

    model_dir: str
    policy: torch.nn.Module
    moved: dict[str, torch.Tensor]
    buckets: dict[str, dict[str, Any]]


def fixtures(tmp: Path) -> Fixtures:
    model_dir = str(build_tiny_model())
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = {k: v.detach().contiguous() for k, v in policy.state_dict().items()}
    names = list(moved)

    def bucket(chosen: list[str], name: str) -> dict[str, Any]:
        path = tmp / f"{name}.safetensors"
        save_file({n: moved[n] for n in chosen}, path)
        return {
            "names": chosen,
            "dtype_names": ["float32"] * len(chosen),
            "shapes": [list(moved[n].shape) for n in chosen],
            "path": str(path),
        }

    buckets = {"first": bucket(names[: len(names) // 2], "first")}
    buckets["second"] = bucket(names[len(names) // 2 :], "second")
    buckets["missing"] = {**buckets["second"], "path": str(tmp / "no-such-file.safetensors")}
    return Fixtures(model_dir, policy, moved, buckets)


#: One step: (name, what to do against a server URL -> a record of what the trainer reads).
Step = tuple[str, Callable[[str], Awaitable[Any]]]


def answer(r: httpx.Response) -> dict[str, Any]:
    """What the trainer reads of a control-plane answer: the status, and for an error its
    frame and type; a 200's JSON keys and values (ids and times left out)."""
    out: dict[str, Any] = {"status": r.status_code}
    try:
        body = r.json()
    except ValueError:
        return out
    if r.status_code >= 400 and isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = str(body["error"].get("message"))
        framed = FRAME.match(message)
        out["type"] = body["error"].get("type")
        out["message"] = framed.group(1) if framed else message
        out["framed"] = framed is not None
    elif isinstance(body, dict):
        out["body"] = {k: v for k, v in body.items() if k not in ("id", "created")}
    return out


def worded(record: dict[str, Any]) -> dict[str, Any]:
    """An error record whose worker message is each engine's own words: status, type, frame."""
    return {k: v for k, v in record.items() if k != "message"}


def script(fx: Fixtures, keys: dict[str, str | None]) -> list[Step]:
    """The steps, each run against both servers; ``keys``: each server's key by URL (the
    secret changes who may call, never what a route answers)."""
    model = fx.model_dir

    async def post(url: str, path: str, body: Any = None, read_s: float = 120) -> httpx.Response:
        async with httpx.AsyncClient(timeout=read_s, headers=bearer(keys[url])) as http:
            return await http.post(url + path, json=body)

    async def get(url: str, path: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60, headers=bearer(keys[url])) as http:
            return await http.get(url + path)

    def control(path: str, body: Any = None, *, exact: bool = True) -> Callable[[str], Any]:
        async def run(url: str) -> Any:
            record = answer(await post(url, path, body))
            return record if exact else worded(record)

        return run

    async def is_paused(url: str) -> Any:
        return answer(await get(url, "/is_paused"))

    async def health(url: str) -> Any:
        return answer(await get(url, "/health"))["status"]

    async def models(url: str) -> Any:
        body = (await get(url, "/v1/models")).json()
        return [(m["id"], m["max_model_len"], m["object"]) for m in body["data"]]

    async def greedy(url: str) -> Any:
        async with InferenceClient([url], api_key=keys[url]) as client:
            c = await client.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))
        return {"tokens": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason}

    async def top_logprobs(url: str) -> Any:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        r = await post(url, "/v1/completions", {**body, "logprobs": 3})
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        return {
            "status": r.status_code,
            "token_logprobs": lp["token_logprobs"],
            "top": [sorted(d.values(), reverse=True) for d in lp["top_logprobs"]],
            "finish": choice["finish_reason"],
        }

    async def completion_text(url: str) -> Any:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        return (await post(url, "/v1/completions", body)).json()["choices"][0]["text"]

    async def seeded_n(url: str) -> Any:
        """Seeds and ``n`` as the trainer reads them: ``n`` samples, each scored by the
        engine as the policy scores it, the same again for the same seed."""
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        async with InferenceClient([url], api_key=keys[url]) as client:
            first = await client.generate_n(PROMPT, sampling, 3)
            again = await client.generate_n(PROMPT, sampling, 3)
        served = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        exact = [
            max(
                (
                    abs(a - b)
                    for a, b in zip(policy_logprobs(served, PROMPT, c.token_ids), c.logprobs)
                ),
                default=0.0,
            )
            < TOLERANCE
            for c in first
        ]
        return {
            "samples": len(first),
            "lengths": [len(c.token_ids) for c in first],
            "scored_as_the_policy": exact,
            "same_seed_same_tokens": [c.token_ids for c in first] == [c.token_ids for c in again],
            "distinct": len({tuple(c.token_ids) for c in first}) > 1,
        }

    async def sampled_tokens(url: str) -> Any:
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        async with InferenceClient([url], api_key=keys[url]) as client:
            return (await client.generate(PROMPT, sampling)).token_ids

    async def stop_token(url: str) -> Any:
        """A stop token id ends the completion, included; ``stop_reason`` names it."""
        async with InferenceClient([url], api_key=keys[url]) as client:
            greedy = await client.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))
            stop = greedy.token_ids[2]
            c = await client.generate(
                PROMPT, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(stop,))
            )
        return {"tokens": c.token_ids, "finish": c.finish_reason, "stop_reason": c.stop_reason}

    async def token_in(url: str, sampling: dict[str, Any]) -> httpx.Response:
        body = {"model": model, "token_ids": PROMPT, "sampling_params": sampling}
        return await post(url, "/inference/v1/generate", body)

    async def token_in_greedy(url: str) -> Any:
        """What verifiers' training client reads of the token-in route (renderers' client)."""
        sampling = {"temperature": 0, "max_tokens": 6, "logprobs": 1, "stop_token_ids": []}
        r = await token_in(url, {**sampling, "skip_special_tokens": False})
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        return {
            "status": r.status_code,
            "output_mode": r.json()["output_mode"],
            "tokens": choice["token_ids"],
            "finish": choice["finish_reason"],
            "logprobs": [e["logprob"] for e in content],
            "entry_keys": sorted({k for e in content for k in e}),
            "entry_ids": [e["token_id"] for e in content],
            "top_ids": [[t["token_id"] for t in e["top_logprobs"]] for e in content],
        }

    async def token_in_seeded(url: str) -> Any:
        """The same seed samples the same tokens; ``n`` gives as many choices."""
        sampling = {"temperature": 1.0, "max_tokens": 6, "seed": 3, "n": 2}
        first, again = (
            (await token_in(url, sampling)).json(),
            (await token_in(url, sampling)).json(),
        )
        ids = [c["token_ids"] for c in first["choices"]]
        return {
            "choices": len(ids),
            "same_seed_same_tokens": ids == [c["token_ids"] for c in again["choices"]],
            "lengths": [len(t) for t in ids],
        }

    async def token_in_refusals(url: str) -> Any:
        """Another model is a 404 NotFoundError; a missing prompt a 400 (vLLM's type for a
        missing field is FastAPI's own, ``Bad Request``: the status is what clients read)."""
        other = await post(
            url,
            "/inference/v1/generate",
            {"model": "nope", "token_ids": [1], "sampling_params": {}},
        )
        missing = await post(url, "/inference/v1/generate", {"sampling_params": {}})
        return {"other-model": worded(answer(other)), "no-token-ids": missing.status_code}

    async def waits_while_paused(url: str) -> Any:
        """A completion sent while paused waits (no answer in 3 s), and completes on resume."""
        out: dict[str, Any] = {}
        async with (
            InferenceClient([url], api_key=keys[url]) as client,
            trio.open_nursery() as nursery,
        ):

            async def send() -> None:
                c = await client.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))
                out["finish"] = c.finish_reason

            nursery.start_soon(send)
            await trio.sleep(3)
            out["answered_while_paused"] = "finish" in out
            out["resume"] = answer(await post(url, "/resume"))["status"]
        return out

    async def checker(url: str) -> Any:
        r = await post(url, "/weight_checker", {"action": "checksum"})
        digests = r.json().get("checksums", {}) if r.status_code == 200 else {}
        return {
            "status": r.status_code,
            "prefixed": all(k.startswith("dp0:pp0:pcp0:tp0:") for k in digests),
            "norm": digests.get("dp0:pp0:pcp0:tp0:model.norm.weight"),
        }

    async def checker_names(url: str) -> Any:
        r = await post(url, "/weight_checker", {"action": "checksum"})
        return sorted(r.json()["checksums"])

    async def serves_the_update(url: str) -> Any:
        """After the complete update, the engine scores what it samples as the moved policy."""
        async with InferenceClient([url], api_key=keys[url]) as client:
            c = await client.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=1))
        want = policy_logprobs(fx.policy, PROMPT, c.token_ids)
        return max(abs(a - b) for a, b in zip(want, c.logprobs)) < TOLERANCE

    async def asleep_completion(url: str) -> Any:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        try:
            return answer(await post(url, "/v1/completions", body, read_s=5))["status"]
        except httpx.ReadTimeout:
            return "no answer in 5 s"

    async def dead_completion(url: str) -> Any:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        return answer(await post(url, "/v1/completions", body))

    async def exits(url: str) -> Any:
        """The server is gone within 60 s (its port refuses connections)."""
        with trio.move_on_after(60):
            while True:
                try:
                    await get(url, "/health")
                except httpx.TransportError:
                    return "exited"
                await trio.sleep(0.5)
        return "still serving after 60 s"

    first, second, missing = (fx.buckets[k] for k in ("first", "second", "missing"))
    return [
        ("health", health),
        ("models", models),
        ("greedy", greedy),
        ("top-logprobs", top_logprobs),
        ("text", completion_text),
        ("seeded-n", seeded_n),
        ("sampled-tokens", sampled_tokens),
        ("stop-token", stop_token),
        ("token-in-greedy", token_in_greedy),
        ("token-in-seeded", token_in_seeded),
        ("token-in-refusals", token_in_refusals),
        ("weight-checker", checker),
        ("weight-checker-names", checker_names),
        ("pause", control("/pause?mode=keep")),
        ("is-paused", is_paused),
        ("weight-checker-paused", checker),
        ("update-before-start", control("/update_weights", {"update_info": first})),
        ("finish-before-start", control("/finish_weight_update", {})),
        ("init", control("/init_weight_transfer_engine", {"init_info": {"backend": "disk"}})),
        ("start", control("/start_weight_update", {})),
        ("start-again", control("/start_weight_update", {})),
        ("update", control("/update_weights", {"update_info": first})),
        ("update-same-again", control("/update_weights", {"update_info": first}, exact=False)),
        ("finish-after-a-failed-update", control("/finish_weight_update", {})),
        ("start-complete", control("/start_weight_update", {})),
        ("update-first", control("/update_weights", {"update_info": first})),
        ("update-second", control("/update_weights", {"update_info": second})),
        ("finish", control("/finish_weight_update", {})),
        ("waits-while-paused", waits_while_paused),
        ("serves-the-update", serves_the_update),
        ("sleep", control("/sleep?level=1")),
        ("completion-after-sleep", asleep_completion),
        ("wake-up", control("/wake_up")),
        ("pause-again", control("/pause?mode=keep")),
        ("start-broken", control("/start_weight_update", {})),
        ("update-broken", control("/update_weights", {"update_info": first})),
        ("update-missing-file", control("/update_weights", {"update_info": missing}, exact=False)),
        ("finish-broken", control("/finish_weight_update", {})),
        ("health-broken", health),
        ("resume-broken", control("/resume")),
        ("completion-broken", dead_completion),
        ("exits", exits),
    ]


def documented_differences() -> dict[str, str]:
    """The table's rows: difference id -> the row."""
    text = DOC.read_text()
    assert TABLE_START in text, f"{DOC} lost its differences table ({TABLE_START})"
    rows = {}
    for line in text.split(TABLE_START, 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        found = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|", line)
        if found:
            rows[found.group(1)] = line
    return rows


def same(a: Any, b: Any) -> bool:
    """Equal, floats within :data:`TOLERANCE`."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=0, abs_tol=TOLERANCE)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


async def test_vllm_and_the_reference_differ_only_where_docs_engines_md_says(
    vllm_disk: RealServer, reference_disk: EngineUrls, tmp_path: Path
):
    fx = await trio.to_thread.run_sync(fixtures, tmp_path)
    (reference,) = reference_disk
    steps = script(fx, {vllm_disk.url: vllm_disk.api_key, reference: reference_disk.api_key})
    assert len({name for name, _ in steps}) == len(steps)
    records: dict[str, dict[str, Any]] = {}
    for name, run in steps:
        records[name] = {
            "vllm": await run(vllm_disk.url),
            "reference": await run(reference),
        }
    differ = {n for n, r in records.items() if not same(r["vllm"], r["reference"])}
    listed = documented_differences()
    report = "\n".join(
        f"  {n}: vllm {records[n]['vllm']!r:.300} | reference {records[n]['reference']!r:.300}"
        for n in sorted(differ ^ set(listed))
        if n in records
    )
    unknown = set(listed) - set(records)
    assert not unknown, f"docs/engines.md lists differences no step records: {sorted(unknown)}"
    assert differ == set(listed), (
        f"differences not in docs/engines.md: {sorted(differ - set(listed))}; listed there "
        f"but the same now: {sorted(set(listed) - differ)}\n{report}"
    )
    # what the trainer's safety rests on, whatever the table says
    for server in ("vllm", "reference"):
        assert records["completion-broken"][server]["status"] == 500
        assert records["completion-broken"][server]["message"] == ENGINE_DEAD_MESSAGE
        assert records["exits"][server] == "exited"
        assert records["serves-the-update"][server] is True
