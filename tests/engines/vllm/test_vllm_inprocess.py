"""engines.vllm.inprocess against vLLM: its own classes where importable, its recorded shapes elsewhere.

Where ``import vllm`` works, the conversions run on vLLM's own ``SamplingParams``,
``RequestOutput``, ``CompletionOutput`` and ``Logprob``. Everywhere (CI included) they also run
against ``reference/vllm_shapes.json``, written from vLLM by ``reference/dump_vllm_shapes.py``:
stand-ins carry exactly the recorded attributes, so a field vLLM renames fails here once the
file is regenerated, and on a machine with vLLM a stale file fails
``test_the_recorded_shapes_are_those_of_the_installed_vllm``.
"""

from __future__ import annotations

import json
import runpy
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from engines.client import (
    CONTROL_PLANE_TIMEOUT_ENV,
)
from engines.types import SamplingParams
from engines.vllm import inprocess as vllm_inprocess
from engines.vllm.async_llm import (
    DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S,
    open_async_llm,
)
from engines.vllm.control import VLLM_URL, load_vllm_classes
from engines.vllm.flags import VllmSettings
from tests.engines.vllm.stand_in import (
    SHAPES,
    OutputClasses,
    StandInAsyncLLM,
    final_output,
    recorded_classes,
    recorded_output_classes,
)
from trainer.errors import (
    ConfigError,
    EngineStartError,
)

RECORDED = Path(__file__).parents[1] / "vllm_recorded"
SAMPLING_FIELDS: dict[str, dict[str, Any]] = SHAPES["SamplingParams"]["fields"]

needs_vllm = pytest.mark.skipif(not vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is not installed")
needs_no_vllm = pytest.mark.skipif(vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is installed here")

PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, max_tokens=32, seed=5, stop_token_ids=(2, 3), ignore_eos=True
)


@pytest.fixture(autouse=True)
def _no_timeout_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set ``control_plane_timeout_s`` themselves: the environment must not win."""
    monkeypatch.delenv(CONTROL_PLANE_TIMEOUT_ENV, raising=False)


def _vllm_classes() -> OutputClasses:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return OutputClasses(RequestOutput, CompletionOutput, Logprob)


@pytest.fixture(
    params=[
        pytest.param(recorded_output_classes, id="recorded-shapes"),
        pytest.param(_vllm_classes, id="vllm", marks=needs_vllm),
    ]
)
def classes(request: pytest.FixtureRequest) -> OutputClasses:
    return request.param()


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
    c = vllm_inprocess.completion_from_output(final_output(classes, "length"))
    assert (c.token_ids, c.logprobs, c.finish_reason, c.prompt_token_ids) == (
        [7, 8],
        [-0.5, -1.5],
        "length",
        [1, 2],
    )
    assert vllm_inprocess.completion_from_output(final_output(classes, "stop")).finish_reason == (
        "stop"
    )


def test_n_samples_convert_in_vllms_index_order(classes: OutputClasses) -> None:
    assert vllm_inprocess.to_vllm_sampling_kwargs(PARAMS, 4)["n"] == 4
    output = final_output(classes, "length")
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
    completion = vllm_inprocess.completion_from_output(final_output(classes, reason))
    assert completion.finish_reason == "abort"


def test_the_recorded_stand_ins_reject_names_vllm_does_not_have() -> None:
    classes = recorded_output_classes()
    with pytest.raises(TypeError):
        classes.logprob(logprob=-0.5, prob=0.6)
    with pytest.raises(AttributeError):
        _ = classes.logprob(logprob=-0.5).prob


@needs_vllm
def test_the_recorded_shapes_are_those_of_the_installed_vllm() -> None:
    dump = runpy.run_path(str(RECORDED / "dump_vllm_shapes.py"))
    installed = json.loads(json.dumps(dump["vllm_shapes"]()))
    assert installed == SHAPES, (
        f"vLLM {installed['vllm_version']} differs from the recorded {SHAPES['vllm_version']}: "
        "run tests/engines/vllm_recorded/dump_vllm_shapes.py and review the diff"
    )


# -- start and stop: in a thread, bounded, always shut down -------------------------------------


@needs_no_vllm
async def test_without_vllm_the_opener_says_in_one_line_what_to_install() -> None:
    t0 = trio.current_time()
    with pytest.raises(ConfigError) as info:
        settings = VllmSettings("any", extra_args=("--seed", "1"))
        async with vllm_inprocess.open_vllm_inprocess_client(settings):
            pytest.fail("opened vLLM without vLLM")
    message = str(info.value)
    assert "\n" not in message
    assert "pip install vllm" in message and "engine.backend=vllm_inprocess" in message
    assert trio.current_time() - t0 < 30  # at once: no import, no thread, no bridge


async def test_a_failed_build_is_an_engine_start_error_with_the_reason() -> None:
    def build() -> Any:
        raise ValueError("vLLM's engine arguments refused ['--max-model-len', 'x']")

    with pytest.raises(EngineStartError, match="refused") as info:
        async with open_async_llm(build, startup_timeout_s=60):
            pytest.fail("started")
    assert info.value.url == VLLM_URL


async def test_the_engine_is_shut_down_on_every_exit() -> None:
    llm = StandInAsyncLLM()
    with trio.CancelScope() as scope:
        async with open_async_llm(lambda: (llm, recorded_classes()), shutdown_timeout_s=5):
            scope.cancel()  # a cancellation (a deadline) ends the block
            await trio.sleep_forever()
    assert llm.calls == [("shutdown", {"timeout": 5})]
    other = StandInAsyncLLM()
    with pytest.raises(KeyError):
        async with open_async_llm(lambda: (other, recorded_classes())):
            raise KeyError("the body failed")
    assert other.shut_down.is_set()


async def test_a_build_past_its_timeout_fails_and_what_it_builds_later_is_shut_down() -> None:
    release = threading.Event()
    llm = StandInAsyncLLM()

    def slow_build() -> Any:
        release.wait(60)  # a real blocked thread: the model still loading
        return llm, recorded_classes()

    with pytest.raises(EngineStartError, match=r"did not start within 0.3s"):
        async with open_async_llm(slow_build, startup_timeout_s=0.3):
            pytest.fail("started")
    assert not llm.shut_down.is_set()
    release.set()
    await trio.to_thread.run_sync(llm.shut_down.wait, 60)
    assert llm.calls == [("shutdown", {"timeout": DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S})]


@needs_vllm
def test_with_vllm_the_classes_and_the_parser_the_engine_uses_import() -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    classes = load_vllm_classes()
    update_info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}
    assert classes.init_request(init_info={"packed": True}).init_info == {"packed": True}
    assert classes.update_request(update_info=update_info).update_info == update_info
    assert callable(AsyncLLM.from_engine_args) and callable(FlexibleArgumentParser)
