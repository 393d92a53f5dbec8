"""``algorithm.overlong_buffer`` and ``algorithm.dynamic_sampling``: DAPO's soft overlong
punishment of the reward and its dynamic sampling (Yu et al. 2025), the sections' keys.
docs/algorithms.md#reward-shaping-dapos-overlong-punishment, #dynamic-sampling.
"""

from __future__ import annotations

from typing import Literal

import attrs

from trainer.config._fields import at_least
from trainer.config._fields import config_field as _field

__all__ = ["DynamicSamplingConfig", "OverlongBufferConfig"]


@attrs.define
class OverlongBufferConfig:
    len: int = _field(
        0,
        "DAPO's soft overlong punishment: the last this-many tokens of the response budget "
        "(generator.max_response_tokens; with one turn at most generator.sampling.max_tokens) are a buffer where a response's reward falls linearly, "
        "by up to overlong_buffer.penalty at the budget (0: off). docs/algorithms.md.",
        check=at_least(0),
    )
    penalty: float = _field(
        1.0, "The punishment of a response that fills its whole budget.", check=at_least(0)
    )


@attrs.define
class DynamicSamplingConfig:
    type: Literal["none", "filter"] = _field(
        "none",
        "'filter' (DAPO's dynamic sampling): a step trains only on groups whose rewards (after "
        "algorithm.overlong_buffer) are not all equal, generating more prompts until it holds "
        "trainer.train_batch_size of them. docs/algorithms.md#dynamic-sampling.",
    )
    max_rounds: int = _field(
        10,
        "type=filter: the most batches of prompts a step generates (fully_async: groups "
        "taken, in batches); past it the step trains on the informative groups it has (or on "
        "the last round's, where none were), with a warning and dynamic_sampling/exhausted=1.",
        check=at_least(1),
    )
