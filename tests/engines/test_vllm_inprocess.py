"""engines.vllm_inprocess against vLLM: its own classes where importable, its recorded shapes elsewhere.

Where ``import vllm`` works, the conversions run on vLLM's own ``SamplingParams``,
``RequestOutput``, ``CompletionOutput`` and ``Logprob``. Everywhere (CI included) they also run
against ``reference/vllm_shapes.json``, written from vLLM by ``reference/dump_vllm_shapes.py``:
stand-ins carry exactly the recorded attributes, so a field vLLM renames fails here once the
file is regenerated, and on a machine with vLLM a stale file fails
``test_the_recorded_shapes_are_those_of_the_installed_vllm``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import runpy
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from engines import vllm_inprocess
from engines.bridge import open_bridge
from engines.types import SamplingParams
from trainer.errors import EngineStartError

REFERENCE = Path(__file__).parent / "reference"
SHAPES: dict[str, Any] = json.loads((REFERENCE / "vllm_shapes.json").read_text())
SAMPLING_FIELDS: dict[str, dict[str, Any]] = SHAPES["SamplingParams"]["fields"]

needs_vllm = pytest.mark.skipif(not vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is not installed")
needs_no_vllm = pytest.mark.skipif(vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is installed here")

PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, max_tokens=32, seed=5, stop_token_ids=(2, 3), ignore_eos=True
)


class OutputClasses(NamedTuple):
    """The three classes a final ``generate`` result is made of."""

    request_output: Any
    completion_output: Any
    logprob: Any


def _stand_in(name: str) -> type:
    """A slotted class with exactly vLLM's recorded attributes (keyword-only; the recorded
    required ones without a default), so reading or passing any other name fails."""
    shape = SHAPES[name]
    fields: list[Any] = [
        (a, Any) if a in shape["required"] else (a, Any, dataclasses.field(default=None))
        for a in shape["attributes"]
    ]
    return dataclasses.make_dataclass(name, fields, kw_only=True, slots=True)


def _recorded_classes() -> OutputClasses:
    return OutputClasses(
        _stand_in("RequestOutput"), _stand_in("CompletionOutput"), _stand_in("Logprob")
    )


def _vllm_classes() -> OutputClasses:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return OutputClasses(RequestOutput, CompletionOutput, Logprob)


@pytest.fixture(
    params=[
        pytest.param(_recorded_classes, id="recorded-shapes"),
        pytest.param(_vllm_classes, id="vllm", marks=needs_vllm),
    ]
)
def classes(request: pytest.FixtureRequest) -> OutputClasses:
    return request.param()


def _final_output(classes: OutputClasses, finish_reason: str | None) -> Any:
    """What ``AsyncLLM.generate`` yields last for prompt [1, 2] and sampled tokens [7, 8]: per
    token, a ``{token_id: Logprob}`` dict that holds the sampled token (here, for token 8,
    also a likelier token 9 that was not sampled)."""
    lp = classes.logprob
    sample = classes.completion_output(
        index=0,
        text="",
        token_ids=[7, 8],
        cumulative_logprob=-2.0,
        logprobs=[
            {7: lp(logprob=-0.5, rank=1)},
            {8: lp(logprob=-1.5, rank=2), 9: lp(logprob=-0.1, rank=1)},
        ],
        finish_reason=finish_reason,
    )
    return classes.request_output(
        request_id="traj-1",
        prompt=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[sample],
        finished=finish_reason is not None,
    )


@needs_no_vllm
async def test_without_vllm_opening_an_engine_says_how_to_get_it() -> None:
    async with open_bridge() as bridge:
        with pytest.raises(EngineStartError) as info:
            async with vllm_inprocess.open_vllm_inprocess(bridge, model="any"):
                pytest.fail("opened vLLM without vLLM")
        with pytest.raises(EngineStartError):
            vllm_inprocess.VLLMInProcessEngine(bridge, llm=None)
    message = str(info.value)
    assert "pip install vllm" in message
    assert "GPU" in message


@needs_vllm
async def test_with_vllm_the_guard_passes_and_the_engine_classes_import() -> None:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs  # the paths open_vllm_inprocess imports
    from vllm.v1.engine.async_llm import AsyncLLM

    assert vllm_inprocess.require_vllm() is vllm
    async with open_bridge() as bridge:
        engine = vllm_inprocess.VLLMInProcessEngine(bridge, llm=None)
    assert engine.urls == ["inprocess://vllm"]
    assert callable(AsyncLLM.from_engine_args)
    assert "model" in inspect.signature(AsyncEngineArgs).parameters


def test_sampling_params_convert_to_vllm_keywords() -> None:
    kwargs = vllm_inprocess.to_vllm_sampling_kwargs(PARAMS)
    assert set(kwargs) <= set(SAMPLING_FIELDS), f"not fields of vLLM {SHAPES['vllm_version']}"
    assert kwargs == {
        "n": 1,  # one sample per request: a trajectory is one completion
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "seed": 5,
        "stop_token_ids": [2, 3],  # vLLM's field is a list[int]
        "ignore_eos": True,
        "logprobs": 0,  # no alternatives: vLLM adds the sampled token's own logprob
    }


def test_default_sampling_params_sample_like_vllms_defaults() -> None:
    kwargs = vllm_inprocess.to_vllm_sampling_kwargs(SamplingParams())
    for name in ("n", "temperature", "top_p", "max_tokens", "seed", "ignore_eos"):
        assert kwargs[name] == SAMPLING_FIELDS[name]["default"], name
    # vLLM's None (no extra stop tokens) is stored as an empty list
    assert kwargs["stop_token_ids"] == []
    assert SAMPLING_FIELDS["stop_token_ids"]["default"] is None


def test_logprobs_zero_returns_only_the_sampled_tokens_logprob() -> None:
    doc = " ".join(SAMPLING_FIELDS["logprobs"]["doc"].split())
    assert "always return the log probability of the sampled token" in doc
    assert "up to `logprobs+1` elements" in doc
    assert vllm_inprocess.to_vllm_sampling_kwargs(PARAMS)["logprobs"] == 0


def test_the_last_streamed_output_holds_the_whole_completion() -> None:
    # generate() keeps the last RequestOutput: right for CUMULATIVE (vLLM's default) and
    # FINAL_ONLY, wrong for DELTA, which would keep only the last tokens
    assert "output_kind" not in vllm_inprocess.to_vllm_sampling_kwargs(PARAMS)
    assert "CUMULATIVE" in SAMPLING_FIELDS["output_kind"]["default"]


@needs_vllm
def test_with_vllm_the_keywords_build_its_sampling_params() -> None:
    import vllm
    from vllm.sampling_params import RequestOutputKind

    built = vllm.SamplingParams(**vllm_inprocess.to_vllm_sampling_kwargs(PARAMS))
    assert (built.n, built.temperature, built.top_p, built.max_tokens, built.seed) == (
        1,
        0.7,
        0.9,
        32,
        5,
    )
    assert (built.stop_token_ids, built.ignore_eos, built.logprobs) == ([2, 3], True, 0)
    assert built.output_kind is RequestOutputKind.CUMULATIVE


def test_a_request_output_converts_to_a_completion(classes: OutputClasses) -> None:
    c = vllm_inprocess.completion_from_output(_final_output(classes, "length"))
    assert (c.token_ids, c.logprobs, c.finish_reason, c.prompt_token_ids) == (
        [7, 8],
        [-0.5, -1.5],
        "length",
        [1, 2],
    )
    assert vllm_inprocess.completion_from_output(_final_output(classes, "stop")).finish_reason == (
        "stop"
    )


def test_n_samples_convert_in_vllms_index_order(classes: OutputClasses) -> None:
    assert vllm_inprocess.to_vllm_sampling_kwargs(PARAMS, 4)["n"] == 4
    output = _final_output(classes, "length")
    second = classes.completion_output(
        index=1,
        text="",
        token_ids=[4],
        cumulative_logprob=-0.25,
        logprobs=[{4: classes.logprob(logprob=-0.25, rank=1)}],
        finish_reason="stop",
    )
    output.outputs = [second, *output.outputs]  # vLLM yields children as they finish
    completions = vllm_inprocess.completions_from_output(output)
    assert [(c.token_ids, c.finish_reason) for c in completions] == [
        ([7, 8], "length"),
        ([4], "stop"),
    ]
    assert completions[1].logprobs == [-0.25]


@pytest.mark.parametrize("reason", ["abort", None])
def test_an_aborted_or_unfinished_output_converts_as_abort(
    classes: OutputClasses, reason: str | None
) -> None:
    completion = vllm_inprocess.completion_from_output(_final_output(classes, reason))
    assert completion.finish_reason == "abort"


def test_the_recorded_stand_ins_reject_names_vllm_does_not_have() -> None:
    classes = _recorded_classes()
    with pytest.raises(TypeError):
        classes.logprob(logprob=-0.5, prob=0.6)
    with pytest.raises(AttributeError):
        _ = classes.logprob(logprob=-0.5).prob


def _recorded_signature(method: str) -> inspect.Signature:
    params = SHAPES["AsyncLLM"]["methods"][method]
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                getattr(inspect.Parameter, p["kind"]),
                default=p.get("default", inspect.Parameter.empty),
            )
            for name, p in params.items()
        ]
    )


@pytest.mark.parametrize(
    ("method", "args", "kwargs"),
    [
        ("from_engine_args", ("engine args",), {}),
        ("generate", ({"prompt_token_ids": [1, 2]}, "sampling params", "request-id"), {}),
        ("pause_generation", (), {"mode": "keep"}),
        ("resume_generation", (), {}),
        ("is_paused", (), {}),
        ("sleep", (1,), {}),
        ("wake_up", (["weights"],), {}),
        ("is_sleeping", (), {}),
        ("reset_prefix_cache", (), {}),
        ("shutdown", (), {}),
    ],
)
def test_the_engine_calls_asyncllm_as_vllm_declares_it(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    _recorded_signature(method).bind(*args, **kwargs)


@needs_vllm
def test_the_recorded_shapes_are_those_of_the_installed_vllm() -> None:
    dump = runpy.run_path(str(REFERENCE / "dump_vllm_shapes.py"))
    installed = json.loads(json.dumps(dump["vllm_shapes"]()))
    assert installed == SHAPES, (
        f"vLLM {installed['vllm_version']} differs from the recorded {SHAPES['vllm_version']}: "
        "run tests/engines/reference/dump_vllm_shapes.py and review the diff"
    )
