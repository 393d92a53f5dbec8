"""Advantages and policy losses: pure torch, no trio, no I/O.

Shapes used throughout:

- ``B`` trajectories, ``T`` response tokens per trajectory (padded), ``V`` vocabulary size.
- ``mask`` is ``[B, T]``, bool or 0/1: nonzero marks a token that is trained on (a
  response token the policy produced); zero marks padding, prompt or tool-output tokens.
  Masked positions never contribute to a loss, a metric or a gradient, whatever values
  (even ``nan`` or ``inf``) they hold.

Usage in a step::

    adv = compute_advantages(rewards, group_ids, "grpo")                  # [B]
    logp = token_logprobs(logits, response_ids, temperature)              # [B, T]
    loss, metrics = policy_loss(logp, old_logp, adv, mask, num_tokens=n)  # scalar
    if kl_coef:
        loss = loss + kl_coef * masked_sum(kl_penalty(logp, ref_logp), mask) / n
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DEFAULT_CLIP_HIGH",
    "DEFAULT_CLIP_LOW",
    "KL_ESTIMATORS",
    "POLICY_LOSS_METRICS",
    "compute_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_logprobs",
]

AdvantageEstimator = Literal["grpo", "rloo"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]

#: The allowed values of ``algorithm.advantage_estimator``.
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
#: The allowed values of ``kl_penalty(kind=...)``.
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
#: PPO clip range below 1 (ratio floor ``1 - clip_low``).
DEFAULT_CLIP_LOW = 0.2
#: PPO clip range above 1 (ratio ceiling ``1 + clip_high``); raise it for "clip-higher" (DAPO).
DEFAULT_CLIP_HIGH = 0.2
#: Log-ratios are clamped to this range before ``exp`` so one wild token cannot overflow to
#: ``inf`` (and ``inf * 0`` to ``nan``); the same bound verl uses. ``exp(20)`` ~ 5e8 is far
#: beyond any clip range, so the clamp never changes a clipped loss.
LOG_RATIO_CLAMP = 20.0
#: ``k3`` is clamped to ``[-K3_CLAMP, K3_CLAMP]`` (as in verl): for a token the reference finds
#: far likelier than the policy, ``exp(ref - logp)`` explodes and would dominate the batch.
K3_CLAMP = 10.0
#: The keys of the metrics dict ``policy_loss`` returns.
POLICY_LOSS_METRICS: tuple[str, ...] = (
    "pg_loss",
    "clip_frac",
    "clip_frac_high",
    "clip_frac_low",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "num_tokens",
)


# --------------------------------------------------------------------------- advantages


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[int] | torch.Tensor,
    estimator: AdvantageEstimator = "grpo",
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-trajectory scalar advantages, computed within groups of samples of one prompt.

    ``rewards`` is ``[B]``; ``group_ids[i]`` names the group (prompt) of trajectory ``i``.
    Groups are found by id, so their members need not be contiguous or in any order.

    - ``"grpo"``: ``(r - mean_g) / (std_g + eps)``, or ``r - mean_g`` when ``norm_by_std`` is
      false (Dr. GRPO). ``std_g`` is the *unbiased* standard deviation (divides by ``n - 1``),
      as ``torch.std`` computes it in verl and in the DeepSeekMath reference: for a group of
      ``n`` samples the advantages then have a population std of ``sqrt((n - 1) / n)``, not 1.
    - ``"rloo"``: ``r_i - mean_{j != i} r_j`` (REINFORCE leave-one-out), never std-normalized.

    Corner cases: a group whose rewards are all equal (including every group of size 1)
    carries no learning signal and gets advantages of exactly ``0.0``, not ``±tiny`` from
    float rounding. The result has ``rewards``' dtype when floating, else the default dtype,
    and lives on ``rewards``' device; it carries no gradient.

    Raises ``ValueError`` for an unknown estimator (naming the allowed ones), a ``rewards``
    that is not 1-D, a length mismatch with ``group_ids``, a non-finite reward, or
    ``eps < 0``.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; allowed: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (one scalar per trajectory), got shape {tuple(rewards.shape)}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    ids = torch.as_tensor(group_ids, device=rewards.device)
    if ids.dim() != 1 or ids.numel() != rewards.numel():
        raise ValueError(
            f"group_ids must give one id per reward: {rewards.numel()} rewards, "
            f"group_ids of shape {tuple(ids.shape)}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    # float64 so that group sums of many samples keep every bit the float32 answer needs.
    r = rewards.detach().to(torch.float64)
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(
            f"rewards must be finite; trajectories {bad[:10]} have nan/inf "
            "(check the reward function)"
        )

    _, inverse = torch.unique(ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, inverse, torch.ones_like(r))
    total = zeros.index_add(0, inverse, r)
    gmax = zeros.scatter_reduce(0, inverse, r, "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, inverse, r, "amin", include_self=False)
    n = count[inverse]
    degenerate = (gmax == gmin)[inverse]  # all-equal rewards; covers every size-1 group

    if estimator == "grpo":
        mean = (total / count)[inverse]
        centered = r - mean
        if norm_by_std:
            sq = zeros.index_add(0, inverse, centered * centered)
            var = sq / (count - 1).clamp(min=1)  # unbiased; size-1 groups are degenerate anyway
            adv = centered / (var.sqrt()[inverse] + eps)
        else:
            adv = centered
    else:
        others_mean = (total[inverse] - r) / (n - 1).clamp(min=1)
        adv = r - others_mean
    adv = torch.where(degenerate, torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


# --------------------------------------------------------------------------- reductions


def _valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.shape != x.shape:
        try:
            mask = mask.expand_as(x)
        except RuntimeError:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not match values of shape {tuple(x.shape)}"
            ) from None
    return mask.to(device=x.device) != 0


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is nonzero (over ``dim``, or everything).

    Masked positions are replaced by zero *before* summing (``torch.where``, not ``x * mask``),
    so ``nan``/``inf`` there neither leak into the sum nor produce ``nan`` gradients.
    Raises ``ValueError`` if ``mask`` cannot be broadcast to ``x``'s shape.
    """
    valid = _valid(x, mask)
    picked = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (over ``dim``, or everything).

    A slice with no valid position has mean ``0.0`` (not ``nan``): an all-padding micro-batch
    must not poison a step. Raises ``ValueError`` if ``mask`` cannot be broadcast to ``x``.
    """
    valid = _valid(x, mask)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    return masked_sum(x, valid, dim) / count.clamp(min=1).to(x.dtype)


# --------------------------------------------------------------------------- losses


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = DEFAULT_CLIP_LOW,
    clip_high: float = DEFAULT_CLIP_HIGH,
    num_tokens: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss with token-mean reduction, and its metrics.

    Per valid token, with ``ratio = exp(logprobs - old_logprobs)``::

        loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

    ``advantages`` is ``[B]`` (one per trajectory, broadcast over its tokens) or ``[B, T]``.
    The loss is ``sum_t loss_t / N`` where ``N`` is the number of valid tokens in this call,
    or ``num_tokens`` when given. Pass the *global* valid-token count of the whole mini-batch
    as ``num_tokens`` to every micro-batch, and the accumulated gradients equal those of one
    full-batch call exactly (each token weighs ``1/N`` whichever micro-batch it is in).

    ``token_weights`` (``[B, T]``, optional, never differentiated) multiplies each
    ``loss_t``: the off-policy correction's importance weights
    (:func:`trainer.off_policy.importance_weights`). ``None`` leaves the loss untouched.

    Metrics (plain floats, over this call's valid tokens, whatever ``num_tokens`` is):
    ``pg_loss`` (the loss value), ``clip_frac`` (share of tokens where the clipped term is the
    active one, so its gradient is zero), ``clip_frac_high``/``clip_frac_low`` (the same, split
    by ``A > 0``/``A < 0``), ``approx_kl`` (mean of ``old - new`` log-probs), ``ratio_mean``,
    ``ratio_max``, ``ratio_min`` and ``num_tokens`` (valid tokens in this call).
    With no valid token the loss is ``0.0`` (still part of the graph) and every metric ``0.0``.

    Log-ratios are clamped to ``±LOG_RATIO_CLAMP`` before ``exp``, and masked positions (of
    log-probs, advantages and token weights) are zeroed first, so garbage there cannot produce
    ``inf``/``nan`` values or gradients.

    Raises ``ValueError`` on mismatched shapes, ``clip_low`` outside ``[0, 1)``, a negative
    ``clip_high`` or a ``num_tokens <= 0``.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must have one shape [B, T]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise ValueError(
            f"token_weights must have logprobs' shape {tuple(logprobs.shape)}, "
            f"got {tuple(token_weights.shape)}"
        )
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if num_tokens is not None and num_tokens <= 0:
        raise ValueError(
            f"num_tokens must be > 0 (the valid-token count of the whole batch), got {num_tokens}"
        )
    if advantages.shape == logprobs.shape[:1] and logprobs.dim() == 2:
        adv = advantages.unsqueeze(-1)
    elif advantages.shape == logprobs.shape:
        adv = advantages
    else:
        raise ValueError(
            f"advantages must be [B] or [B, T] for logprobs of shape {tuple(logprobs.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    valid = _valid(logprobs, mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # zeroed where masked too: an inf advantage there would make 0 * inf = nan gradients
    adv = torch.where(valid, adv.detach().to(logprobs.dtype).expand_as(logprobs), zero)

    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach().to(per_token), zero)

    n_valid = int(valid.sum())
    denom = float(num_tokens) if num_tokens is not None else float(max(n_valid, 1))
    loss = masked_sum(per_token, valid) / denom

    with torch.no_grad():
        if n_valid == 0:
            metrics: dict[str, float] = dict.fromkeys(POLICY_LOSS_METRICS, 0.0)
            metrics["pg_loss"] = float(loss.detach())
            return loss, metrics
        is_clipped = (clipped > unclipped) & valid
        r_valid = ratio[valid]
        metrics = {
            "pg_loss": float(loss.detach()),
            "clip_frac": float(is_clipped.sum()) / n_valid,
            "clip_frac_high": float((is_clipped & (adv > 0)).sum()) / n_valid,
            "clip_frac_low": float((is_clipped & (adv < 0)).sum()) / n_valid,
            "approx_kl": float(masked_mean(-log_ratio, valid)),
            "ratio_mean": float(r_valid.mean()),
            "ratio_max": float(r_valid.max()),
            "ratio_min": float(r_valid.min()),
            "num_tokens": float(n_valid),
        }
    return loss, metrics


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from sampled tokens' log-probs.

    With ``d = logprobs - ref_logprobs`` (tokens sampled from the policy):

    - ``"k1"``: ``d`` — unbiased, high variance, can be negative per token.
    - ``"k2"``: ``d**2 / 2`` — low variance, biased.
    - ``"k3"``: ``exp(-d) + d - 1`` (= ``exp(ref - logp) - (ref - logp) - 1``) — unbiased,
      low variance, never negative. As in verl, ``ref - logp`` is clamped to ``[-20, 20]``
      before ``exp`` and the result to ``[-K3_CLAMP, K3_CLAMP]`` so one token the reference
      finds far likelier cannot dominate the batch.
    - ``"abs"``: ``|d|``.

    Returns a tensor of ``logprobs``' shape; reduce it with ``masked_mean``/``masked_sum``.
    Gradients flow to ``logprobs`` only. Raises ``ValueError`` for an unknown ``kind``
    (naming the allowed ones) or mismatched shapes.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have one shape"
        )
    d = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return d.abs()
    log_r = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each of ``token_ids`` under ``softmax(logits / temperature)``.

    ``logits`` is ``[..., V]`` and ``token_ids`` ``[...]`` (the same leading shape); the
    result has ``token_ids``' shape. Use the sampler's temperature, or the logprobs will not
    match the rollout's.

    Memory: for float32/float64 logits this is ``gather - logsumexp`` and never materializes
    a ``[..., V]`` log-softmax; half-precision logits are upcast to float32 one row of the
    leading dimension at a time, so peak extra memory is one row's ``[T, V]`` in float32,
    not the whole batch's.

    Raises ``ValueError`` for ``temperature <= 0`` or shapes that do not line up, and
    ``IndexError`` (from torch) for a token id outside ``[0, V)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be token_ids' shape {tuple(token_ids.shape)} "
            "plus a vocabulary dimension"
        )
    ids = token_ids.long().unsqueeze(-1)

    def rows(lg: torch.Tensor, ix: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:
            lg = lg / temperature
        picked = lg.gather(-1, ix).squeeze(-1)
        return picked - torch.logsumexp(lg, dim=-1)

    if logits.dtype in (torch.float32, torch.float64):
        return rows(logits, ids)
    if logits.dim() == 1:
        return rows(logits.float(), ids)
    return torch.stack([rows(lg.float(), ix) for lg, ix in zip(logits, ids)])
