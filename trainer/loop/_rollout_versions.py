"""Which weights sampled which tokens, while weights change under running rollouts (fully-async).

:class:`VersionedEngine` is the engine client a generator sees under
``trainer.strategy=fully_async``. It labels every sampled token with the weight version that
produced it (``Completion.weight_versions``) and, with ``engine.pause_mode=abort``, hides the
aborts of a weight sync from generator code: an aborted request is sent again as its prompt
plus the tokens sampled so far, with the tokens left of its budget, and the two parts are
returned as one completion whose tokens carry their own versions.

How a request's version is known (the engine does not say which weights served it):

- a request sent while no sync is under way runs on the current version; with ``abort``
  a sync ends it (``finish_reason='abort'``) before the weights change, so each of its
  tokens is of that version;
- a request sent while a sync is under way (``WeightVersions.syncing``) either was aborted
  by that sync's pause (then it ran on the old weights) or queued behind the pause and ran
  on the new ones;
- with ``keep`` (frozen, then continued on the new weights) and ``wait`` the split point is
  unknown, so every token is labelled with the version the request started on: the oldest
  that may have produced it, which overstates staleness rather than hiding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from engines.types import Completion, EngineClient, PauseMode, SamplingParams, nth_sample_params
from trainer.loop._versions import WeightVersions
from trainer.vocabulary import open_owner_nursery

__all__ = ["VersionedEngine"]


class VersionedEngine:
    """An :class:`~engines.types.EngineClient` whose completions carry their weight versions.

    ``generate`` and ``generate_n`` are wrapped; every other attribute is the wrapped
    client's (``urls``, the control calls), so a generator written for the synchronous loop
    runs unchanged.
    """

    def __init__(self, engine: EngineClient, versions: WeightVersions, pause_mode: PauseMode):
        self._engine = engine
        self._versions = versions
        self._pause_mode: PauseMode = pause_mode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def urls(self) -> Sequence[str]:
        return self._engine.urls

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        sent_at, sent_syncing = self._versions.current, self._versions.syncing
        completion = await self._engine.generate(prompt_ids, sampling, trajectory_id=trajectory_id)
        return await self._finish(
            prompt_ids, sampling, completion, sent_at, sent_syncing, trajectory_id
        )

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
    ) -> list[Completion]:
        sent_at, sent_syncing = self._versions.current, self._versions.syncing
        completions = await self._engine.generate_n(
            prompt_ids, sampling, n, trajectory_id=trajectory_id
        )
        out: list[Completion] = list(completions)

        async def finish(i: int) -> None:
            # an aborted child continues alone, sampled as it was (seed + i)
            out[i] = await self._finish(
                prompt_ids,
                nth_sample_params(sampling, i),
                completions[i],
                sent_at,
                sent_syncing,
                trajectory_id,
            )

        async with open_owner_nursery() as nursery:
            for i in range(len(completions)):
                nursery.start_soon(finish, i)
        return out

    async def _finish(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        completion: Completion,
        sent_at: int,
        sent_syncing: bool,
        trajectory_id: str | None,
    ) -> Completion:
        """Label ``completion``'s tokens; with ``abort``, continue it until it really ends."""
        tokens, logprobs, versions = [], [], []
        while True:
            label = self._versions.label(
                completion.finish_reason, self._pause_mode, sent_at, sent_syncing
            )
            tokens += completion.token_ids
            logprobs += completion.logprobs
            versions += [label] * len(completion.token_ids)
            left = sampling.max_tokens - len(tokens)
            if completion.finish_reason != "abort" or self._pause_mode != "abort" or left <= 0:
                break
            # the sync's pause ended it: send the rest again; it queues until /resume
            sent_at, sent_syncing = self._versions.current, self._versions.syncing
            completion = await self._engine.generate(
                prompt_ids + tokens,
                attrs.evolve(sampling, max_tokens=left),
                trajectory_id=trajectory_id,
            )
        finish = completion.finish_reason
        if finish == "abort" and self._pause_mode == "abort":
            finish = "length"  # the budget ran out exactly at the abort
        return attrs.evolve(
            completion,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=finish,
            prompt_token_ids=list(prompt_ids),
            weight_versions=versions,
        )
