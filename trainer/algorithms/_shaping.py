"""Reward shaping before the advantages: DAPO's soft overlong punishment. Pure torch."""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl
    ``reward_model.overlong_buffer``), added to each trajectory's reward, ``[B]``, never
    positive::

        0                                       if L <= L_max - L_buf
        -penalty * (L - (L_max - L_buf)) / L_buf  otherwise (-penalty at L = L_max)

    ``lengths`` (``[B]``) are the responses' lengths ``L``, ``max_length`` their budget
    ``L_max``, ``buffer_len`` the buffer ``L_buf`` at its end. A response that runs into the
    budget is punished more the deeper it runs, so the policy learns to finish before it,
    instead of learning from truncated answers' rewards. Raises ``ValueError`` unless
    ``0 < buffer_len <= max_length`` and ``penalty >= 0``.
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(
            f"the overlong buffer must be in (0, max_length={max_length}], got {buffer_len}"
        )
    if penalty < 0:
        raise ValueError(f"the overlong penalty must be >= 0, got {penalty}")
    expected = max_length - buffer_len
    exceed = lengths.to(torch.float64) - expected
    return torch.clamp(-exceed / buffer_len * penalty, max=0.0)
