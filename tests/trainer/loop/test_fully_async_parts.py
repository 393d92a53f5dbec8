"""The parts of the fully-async strategy alone: admission, the prompt stream, version labels.

Admission waits are checked under trio's MockClock; version labels against the real
in-process reference engine, paused and resumed for real while a held decode step is in flight.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from engines.local.inprocess import open_inprocess_client
from engines.models import build_tiny_model
from engines.types import SamplingParams
from tests.engines.helpers import StepGate
from trainer.data._examples import PromptLoader, epoch_order, task_examples
from trainer.errors import ConfigError
from trainer.loop import PromptStream, VersionedEngine, WeightVersions
from trainer.loop._staleness import Admission, staleness

# ---------------------------------------------------------------- admission


async def test_admission_waits_for_a_sync_once_the_bound_is_full(autojump_clock):
    versions = WeightVersions()
    adm = Admission(2, 1, versions)  # room for (1 + 0 + 1) * 2 = 4 groups
    for _ in range(4):
        assert await adm.admit() == 0
    admitted_at: list[float] = []

    async def fifth() -> None:
        admitted_at.append(await adm.admit())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fifth)
        await trio.sleep(100)
        assert admitted_at == []  # still waiting: the bound is full
        versions.synced(1)  # the engines serve step 1: room for two more
        await trio.sleep(1)
    assert admitted_at == [1] and adm.admitted == 5


async def test_a_released_place_admits_a_waiting_group(autojump_clock):
    adm = Admission(1, 0, WeightVersions())
    await adm.admit()
    with trio.move_on_after(10) as waited:
        await adm.admit()
    assert waited.cancelled_caught
    adm.release()
    with trio.fail_after(1):
        await adm.admit()


async def test_a_resumed_admission_counts_the_trained_steps_groups():
    versions = WeightVersions(current=11, policy_step=10)  # after the resumed run's first sync
    adm = Admission.resumed(4, 2, versions)
    assert (adm.policy_step, adm.admitted, adm.capacity) == (10, 40, (2 + 10 + 1) * 4)
    versions.synced(None)  # a restarted engine's sync: the same policy, the same bound
    assert (versions.current, adm.policy_step, adm.capacity) == (12, 10, 52)


@pytest.mark.parametrize("seed", range(20))
def test_groups_trained_in_admission_order_are_never_older_than_the_bound(seed):
    """Simulate admission with syncs after every step and random finish times (never
    overtaking): every group's staleness when trained stays within the bound, and the bound
    is reached (so the check can fail)."""
    rng = random.Random(seed)
    batch, bound = 3, rng.randint(0, 3)
    admitted: list[int] = []  # policy step of each admitted group, in admission order
    policy = trained = 0
    worst = 0
    for step in range(1, 30):
        # the producers run ahead as far as admission lets them
        while len(admitted) < (bound + policy + 1) * batch and rng.random() < 0.9:
            admitted.append(policy)
        while len(admitted) < trained + batch:  # the trainer waits for a full batch
            admitted.append(policy)
        for p in admitted[trained : trained + batch]:
            worst = max(worst, staleness(step, p))
            assert staleness(step, p) <= bound
        trained += batch
        policy = step  # weights synced after the step
    assert worst == bound or bound == 0


# ---------------------------------------------------------------- prompt stream


def _stream(n: int = 6, epochs: int = 2) -> PromptStream:
    return PromptStream(task_examples("max_digit", n, 0), seed=3, epochs=epochs)


async def test_the_stream_hands_out_every_epoch_in_the_loaders_order():
    stream = _stream()
    got = [(await stream.take())[1] for _ in range(12)]
    loader = PromptLoader(stream.examples, batch_size=6, seed=3)
    assert got == loader.next_batch() + loader.next_batch()
    assert stream.exhausted


async def test_an_exhausted_stream_waits_until_a_prompt_is_requeued(autojump_clock):
    stream = _stream(n=2, epochs=1)
    k0, _ = await stream.take()
    await stream.take()
    with trio.move_on_after(5) as waited:
        await stream.take()
    assert waited.cancelled_caught
    stream.requeue(k0)
    with trio.fail_after(1):
        key, example = await stream.take()
    assert key == k0 and example == stream.example(k0)


async def test_a_resumed_stream_hands_out_the_in_flight_prompts_first_then_continues():
    stream = _stream()
    keys = [(await stream.take())[0] for _ in range(5)]
    stream.trained(keys[0])
    stream.trained(keys[2])
    stream.requeue(keys[4])  # dropped as stale
    state = stream.state_dict()
    resumed = _stream()
    resumed.load_state_dict(state)
    again = [(await resumed.take())[0] for _ in range(4)]
    assert again == [keys[1], keys[3], keys[4], (0, 5)]
    assert resumed.example((0, 5)) == stream.examples[epoch_order(6, 3, 0)[5]]


def test_the_stream_refuses_a_synchronous_runs_checkpoint_and_the_loader_an_async_one():
    stream, loader = _stream(), PromptLoader(task_examples("max_digit", 6, 0), 2, 3)
    with pytest.raises(
        ConfigError, match=r"cannot resume a checkpoint of a trainer\.strategy='sync'"
    ):
        stream.load_state_dict(loader.state_dict())
    with pytest.raises(
        ConfigError, match=r"cannot resume a checkpoint of a trainer\.strategy='fully"
    ):
        loader.load_state_dict(stream.state_dict())
    with pytest.raises(ConfigError, match=r"trainer\.seed differs"):
        PromptStream(stream.examples, seed=4, epochs=1).load_state_dict(stream.state_dict())
    # each state names its strategy; one saved before it did is told by its fields
    assert (loader.state_dict()["strategy"], stream.state_dict()["strategy"]) == (
        "sync",
        "fully_async",
    )
    old_sync = {k: v for k, v in loader.state_dict().items() if k != "strategy"}
    old_async = {k: v for k, v in stream.state_dict().items() if k != "strategy"}
    with pytest.raises(ConfigError, match=r"of a trainer\.strategy='sync' run;"):
        _stream().load_state_dict(old_sync)
    with pytest.raises(ConfigError, match=r"'fully_async' run \(its prompts in flight"):
        PromptLoader(task_examples("max_digit", 6, 0), 2, 3).load_state_dict(old_async)
    PromptLoader(task_examples("max_digit", 6, 0), 2, 3).load_state_dict(old_sync)
    _stream().load_state_dict(old_async)


# ---------------------------------------------------------------- version labels


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model()


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here runs with one torch thread (see ``one_torch_thread``)."""


class _Spy:
    """Records each request's prompt length and finish reason on the way through."""

    def __init__(self, client) -> None:
        self.client = client
        self.urls = client.urls
        self.calls: list[tuple[int, str, int]] = []

    async def generate(self, prompt_ids, sampling, *, trajectory_id=None):
        c = await self.client.generate(prompt_ids, sampling, trajectory_id=trajectory_id)
        self.calls.append((len(prompt_ids), c.finish_reason, len(c.token_ids)))
        return c

    async def generate_n(self, prompt_ids, sampling, n, *, trajectory_id=None):
        cs = await self.client.generate_n(prompt_ids, sampling, n, trajectory_id=trajectory_id)
        self.calls += [(len(prompt_ids), c.finish_reason, len(c.token_ids)) for c in cs]
        return cs


async def _sync_while(client, versions: WeightVersions, mode: str, requeued: int) -> None:
    """What ``trainer.loop._steps.sync_weights`` does around a transfer, with the engine running.

    The "transfer" lasts until ``requeued`` requests queue behind the pause (with ``abort``,
    the aborted ones come back as continuations), so they are sent while the sync runs.
    """
    versions.syncing = True
    await client.pause(mode)
    with trio.fail_after(60):
        while client.engine.num_waiting < requeued:  # noqa: ASYNC110 (no event for it)
            await trio.sleep(0.005)
    await client.resume()
    versions.syncing = False
    versions.current += 1


LONG = SamplingParams(temperature=1.0, max_tokens=48, seed=7, ignore_eos=True)
#: The decode step during which the sync's pause lands: the tokens of the steps up to and
#: including it are sampled on version 0 (the step in flight finishes), the rest on version 1.
SPLIT = 5


async def _roll_during_a_sync(model_dir: Path, mode: str, n: int):
    """``n`` samples of one prompt, with a weight sync that pauses the engine while step
    ``SPLIT`` runs (held at a :class:`StepGate`, so however fast the engine, the requests are
    in flight with ``SPLIT`` tokens each when the weights change)."""
    async with open_inprocess_client(model_dir) as client:
        spy = _Spy(client)
        versions = WeightVersions(current=0)
        engine = VersionedEngine(spy, versions, mode)  # type: ignore[arg-type]
        out = []
        with StepGate(client.engine, hold={SPLIT}) as gate:
            async with trio.open_nursery() as nursery:

                async def roll() -> None:
                    out.extend(await engine.generate_n([1, 2, 3], LONG, n))

                nursery.start_soon(roll)
                await gate.reached(SPLIT)
                assert client.engine.num_running == n  # all in flight, in the held step
                requeued = n if mode == "abort" else 0
                await gate.pause_at(SPLIT, partial(_sync_while, client, versions, mode, requeued))
        return out, spy.calls


async def test_with_abort_a_sync_splits_a_request_and_each_part_carries_its_version(model_dir):
    out, calls = await _roll_during_a_sync(model_dir, "abort", n=2)
    assert [c.finish_reason for c in out] == ["length", "length"]
    for i, c in enumerate(out):
        # the engine saw the first part end in an abort and the rest sent as prompt + tokens
        first = calls[i]
        assert first[1] == "abort" and first[2] == SPLIT, calls
        assert len(c.token_ids) == len(c.logprobs) == len(c.weight_versions) == 48
        assert c.weight_versions == [0] * first[2] + [1] * (48 - first[2])
        assert c.prompt_token_ids == [1, 2, 3]
    continuations = calls[2:]
    assert sorted(p for p, _, _ in continuations) == sorted(3 + calls[i][2] for i in range(2))


async def test_with_keep_a_frozen_request_is_labelled_with_the_version_it_started_on(model_dir):
    out, calls = await _roll_during_a_sync(model_dir, "keep", n=1)
    (c,) = out
    assert len(calls) == 1 and c.finish_reason == "length"  # frozen, then continued: one request
    assert c.weight_versions == [0] * 48


@pytest.mark.parametrize(
    ("finish", "mode", "syncing", "label"),
    [
        ("length", "abort", False, 5),
        ("abort", "abort", True, 5),  # ended by the sync's pause: old weights
        ("stop", "abort", True, 6),  # queued behind the pause: new weights
        ("stop", "keep", True, 5),  # frozen then continued: labelled with the oldest
        ("stop", "wait", True, 5),
    ],
)
def test_the_label_of_a_request(finish, mode, syncing, label):
    assert WeightVersions(5).label(finish, mode, 5, syncing) == label
