"""Advantage estimators: ``algorithm.advantage_estimator`` (the registry
:data:`~trainer.algorithms.ADVANTAGE_ESTIMATORS`). Pure torch, no trio, no I/O.

Each estimator reads an :class:`AdvantageInputs` (the rewards, their groups: the samples of
one prompt, and the response tokens) and returns per-trajectory advantages ``[B]`` or per-token
ones ``[B, T]`` (zero at masked tokens); :func:`compute_advantages` checks the inputs and calls
the one named. The outcome reward of a trajectory is one scalar: the reward of its last trained
token, every earlier token's being 0. Token-level rewards (``token_rewards``: the KL in the
reward, ``algorithm.use_kl_in_reward``) add to each trained token's, as verl's
``token_level_rewards``: the per-token estimators (:data:`TOKEN_REWARD_ESTIMATORS`) read them
token by token, every other estimator the trajectory's sum (verl's ``scores =
token_level_rewards.sum(-1)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trainer.algorithms._registry import ADVANTAGE_ESTIMATORS

__all__ = [
    "TOKEN_REWARD_ESTIMATORS",
    "WHITEN_EPS",
    "AdvantageInputs",
    "compute_advantages",
    "gae",
    "gae_advantages_and_returns",
    "grpo",
    "grpo_passk",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
]

#: The estimators that read token-level rewards token by token (the others, their sum).
TOKEN_REWARD_ESTIMATORS = frozenset({"reinforce_plus_plus", "gae"})
#: Added to the batch's variance before the square root when whitening (as verl's
#: ``masked_whiten``).
WHITEN_EPS = 1e-8


@attrs.frozen
class AdvantageInputs:
    """What an estimator reads: float64 rewards, each trajectory's group and the token mask."""

    #: ``[B]`` float64, finite.
    rewards: torch.Tensor
    #: ``[B]`` the group (prompt) of each trajectory, numbered ``0 .. G - 1``.
    index: torch.Tensor
    #: ``[B, T]`` bool, the trained (response) tokens; None where the caller gave none.
    mask: torch.Tensor | None
    norm_by_std: bool
    gamma: float
    eps: float
    #: ``[B, T]`` float64, the critic's value of each position (``gae``); None without a critic.
    values: torch.Tensor | None = None
    #: GAE's lambda.
    lam: float = 1.0
    #: ``[B, T]`` float64 rewards of the trained tokens besides the outcome (0 elsewhere), for
    #: :data:`TOKEN_REWARD_ESTIMATORS`; None: the outcome alone.
    token_rewards: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return int(self.index.max()) + 1

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[G]``: the sum of ``values`` (``[B]``) over each group."""
        zeros = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return zeros.index_add(0, self.index, values)

    def group_count(self) -> torch.Tensor:
        """``[G]``: the number of trajectories of each group."""
        return self.group_sum(torch.ones_like(self.rewards))

    def group_mean(self) -> torch.Tensor:
        """``[B]``: the mean reward of each trajectory's group."""
        return (self.group_sum(self.rewards) / self.group_count())[self.index]

    def degenerate(self) -> torch.Tensor:
        """``[B]`` bool: the trajectory's group has all-equal rewards (every group of one)."""
        zeros = torch.zeros(self.num_groups, dtype=self.rewards.dtype, device=self.rewards.device)
        gmax = zeros.scatter_reduce(0, self.index, self.rewards, "amax", include_self=False)
        gmin = zeros.scatter_reduce(0, self.index, self.rewards, "amin", include_self=False)
        return (gmax == gmin)[self.index]

    def token_mask(self, estimator: str) -> torch.Tensor:
        """The mask, for an estimator that works per token (``ValueError`` without one)."""
        if self.mask is None:
            raise ValueError(
                f"advantage estimator {estimator!r} works per token: pass mask=batch.loss_mask"
            )
        return self.mask

    def token_values(self, estimator: str) -> torch.Tensor:
        """The critic's values, for an estimator that reads them (``ValueError`` without)."""
        if self.values is None:
            raise ValueError(
                f"advantage estimator {estimator!r} reads a critic's values: pass values=batch.values"
            )
        return self.values


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[int] | torch.Tensor,
    estimator: str = "grpo",
    *,
    mask: torch.Tensor | None = None,
    norm_by_std: bool = True,
    gamma: float = 1.0,
    eps: float = 1e-6,
    values: torch.Tensor | None = None,
    lam: float = 1.0,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of ``B`` trajectories by the estimator named ``estimator``.

    ``rewards`` is ``[B]``; ``group_ids[i]`` names the group (prompt) of trajectory ``i``:
    groups are found by id, so their members need not be contiguous or in any order. ``mask``
    (``[B, T]``, the trained tokens) is needed by the per-token estimators
    (``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gae``). ``norm_by_std``: GRPO
    and pass@k divide by the group's std. ``gamma``: REINFORCE++'s and GAE's discount.
    ``values`` (``[B, T]`` like ``mask``) and ``lam``: GAE's critic values and lambda.
    ``token_rewards`` (``[B, T]`` like ``mask``; only trained tokens' count): rewards added to
    each token's, the outcome staying on the last; ``reinforce_plus_plus`` and ``gae`` read
    them per token, the others each trajectory's outcome plus their sum.

    The result is ``[B]`` or ``[B, T]`` (see each estimator), in ``rewards``' dtype when
    floating, else the default dtype, on ``rewards``' device, without gradient.

    Raises ``ValueError`` for an unknown estimator (naming the allowed ones), a ``rewards``
    that is not 1-D, a length mismatch with ``group_ids`` or ``mask``, a non-finite reward,
    ``eps < 0``, or ``gamma`` or ``lam`` outside ``[0, 1]``.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (one scalar per trajectory), got shape {tuple(rewards.shape)}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    ids = torch.as_tensor(group_ids, device=rewards.device)
    if ids.dim() != 1 or ids.numel() != rewards.numel():
        raise ValueError(
            f"group_ids must give one id per reward: {rewards.numel()} rewards, "
            f"group_ids of shape {tuple(ids.shape)}"
        )
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != rewards.numel()):
        raise ValueError(
            f"mask must be [B, T] with B = {rewards.numel()} trajectories, "
            f"got shape {tuple(mask.shape)}"
        )
    if token_rewards is not None and (mask is None or token_rewards.shape != mask.shape):
        raise ValueError(
            f"token_rewards must be [B, T] like mask, got shape {tuple(token_rewards.shape)} "
            f"(mask: {None if mask is None else tuple(mask.shape)})"
        )
    if values is not None and (mask is None or values.shape != mask.shape):
        raise ValueError(
            f"values must be [B, T] like mask, got shape {tuple(values.shape)} "
            f"(mask: {None if mask is None else tuple(mask.shape)})"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if rewards.numel() == 0:
        shape = (0,) if mask is None else tuple(mask.shape)
        return torch.zeros(shape, dtype=out_dtype, device=rewards.device)
    # float64 so that group sums of many samples keep every bit the float32 answer needs.
    r = rewards.detach().to(torch.float64)
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(
            f"rewards must be finite; trajectories {bad[:10]} have nan/inf "
            "(check the reward function)"
        )
    _, index = torch.unique(ids, return_inverse=True)
    valid = None if mask is None else mask.to(device=r.device) != 0
    v = None if values is None else values.detach().to(device=r.device, dtype=torch.float64)
    per_token = None
    if token_rewards is not None:
        assert valid is not None
        tr = token_rewards.detach().to(device=r.device, dtype=torch.float64)
        per_token = torch.where(valid, tr, torch.zeros_like(tr))
        if estimator not in TOKEN_REWARD_ESTIMATORS:  # verl: scores = token_level_rewards.sum(-1)
            r, per_token = r + per_token.sum(-1), None
    inputs = AdvantageInputs(r, index, valid, norm_by_std, gamma, eps, v, lam, per_token)
    return fn(inputs).to(out_dtype)


def grpo(x: AdvantageInputs) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath; verl ``grpo``, SkyRL ``grpo``), ``[B]``.

    ``(r - mean_g) / (std_g + eps)`` over each group ``g``, where ``std_g`` is the *unbiased*
    standard deviation (divides by ``n - 1``), as ``torch.std`` in verl and the DeepSeekMath
    reference: a group's advantages then have a population std of ``sqrt((n - 1) / n)``, not 1.
    Without ``norm_by_std``: ``r - mean_g`` (Dr. GRPO, Liu et al. 2025: verl
    ``norm_adv_by_std_in_grpo=False``, SkyRL ``grpo_norm_by_std=false``).

    A group whose rewards are all equal (every group of one) carries no learning signal and
    gets exactly ``0.0``, not ``±tiny`` from float rounding.
    """
    centered = x.rewards - x.group_mean()
    adv = centered
    if x.norm_by_std:
        var = x.group_sum(centered * centered) / (x.group_count() - 1).clamp(min=1)
        adv = centered / (var.sqrt()[x.index] + x.eps)
    return torch.where(x.degenerate(), torch.zeros_like(adv), adv)


def rloo(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024; verl ``rloo``, SkyRL ``rloo``), ``[B]``:
    ``r_i - mean_{j != i} r_j`` over the other samples of ``i``'s group, never divided by a
    std. A group with all-equal rewards (every group of one) gets exactly ``0.0``."""
    n = x.group_count()[x.index]
    others_mean = (x.group_sum(x.rewards)[x.index] - x.rewards) / (n - 1).clamp(min=1)
    adv = x.rewards - others_mean
    return torch.where(x.degenerate(), torch.zeros_like(adv), adv)


def grpo_passk(x: AdvantageInputs) -> torch.Tensor:
    """Pass@k training's outcome advantage (verl ``grpo_passk``, after Chen et al. 2025,
    arXiv:2503.19595), ``[B]``: in each group only the best response learns, with advantage
    ``r_max - r_second`` (divided by ``std_g + eps``, the unbiased group std, when
    ``norm_by_std``); every other response gets 0. Of equal best rewards the first (lowest
    index) is the best and the advantage is 0. Every group needs at least 2 samples
    (``ValueError`` naming the first that has fewer)."""
    adv = torch.zeros_like(x.rewards)
    for g in range(x.num_groups):
        members = torch.nonzero(x.index == g).flatten()
        if members.numel() < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 samples per group; group {g} has "
                f"{members.numel()} (set generator.n_samples_per_prompt >= 2)"
            )
        r = x.rewards[members]
        best = int(torch.argmax(r))  # the first of the maxima
        second = torch.cat([r[:best], r[best + 1 :]]).max()
        value = r[best] - second
        if x.norm_by_std and value > 0:  # a tie is 0, not 0 / 0 when eps is 0
            value = value / (r.std() + x.eps)
        adv[members[best]] = value
    return adv


def _discounted_returns(x: AdvantageInputs, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: ``gamma ** k * r`` at each trained token, ``k`` the number of trained tokens
    after it in its trajectory (the outcome reward sits on the last one); 0 elsewhere. With
    token-level rewards, each trained token's return is ``sum_j gamma ** j * r_(t+j)`` over
    it and the trained tokens after it, ``r`` its own reward (the outcome added on the last)."""
    if x.token_rewards is not None:
        rewards = x.token_rewards + _outcome_on_last(x.rewards, mask)
        running = torch.zeros_like(x.rewards)
        returns = torch.zeros_like(rewards)
        for t in reversed(range(mask.shape[1])):
            running = torch.where(mask[:, t], rewards[:, t] + x.gamma * running, running)
            returns[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
        return returns
    m = mask.to(torch.float64)
    after = m.flip(-1).cumsum(-1).flip(-1) - m
    returns = x.rewards[:, None] * torch.pow(torch.full_like(after, x.gamma), after)
    return torch.where(mask, returns, torch.zeros_like(returns))


def _outcome_on_last(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float64: each trajectory's outcome reward on its last trained token, 0 on
    every other."""
    m = mask.to(torch.float64)
    after = m.flip(-1).cumsum(-1).flip(-1) - m
    return torch.where((after == 0) & mask, rewards[:, None], torch.zeros_like(m))


def _whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(v - mean) / sqrt(var + WHITEN_EPS)`` over the batch's trained tokens (mean and the
    unbiased variance taken over tokens, as verl's ``masked_whiten``); 0 at masked tokens, and
    everywhere when the trained tokens' values are all equal (no signal)."""
    picked = values[mask]
    if picked.numel() < 2 or bool(picked.max() == picked.min()):
        return torch.zeros_like(values)
    mean = picked.mean()
    var = ((picked - mean) ** 2).sum() / (picked.numel() - 1)
    out = (values - mean) / torch.sqrt(var + WHITEN_EPS)
    return torch.where(mask, out, torch.zeros_like(out))


def reinforce_plus_plus(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; verl ``reinforce_plus_plus``, SkyRL
    ``reinforce_plus_plus``), ``[B, T]``: each trained token's discounted return
    ``gamma ** k * r`` (``k`` trained tokens after it: an environment's tokens in a multi-turn
    trajectory are not steps of the policy and are skipped; verl's loop carries the return
    through them unchanged, the same), whitened over all trained tokens of the batch (global, not per group: the
    paper's point). The paper also folds a per-token KL penalty into the reward: here that is
    ``algorithm.use_kl_in_reward`` (``token_rewards``: each token's return then sums the
    discounted rewards of it and the trained tokens after it), or the loss's
    (``algorithm.use_kl_loss``)."""
    mask = x.token_mask("reinforce_plus_plus")
    return _whiten(_discounted_returns(x, mask), mask)


def reinforce_plus_plus_baseline(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv:2501.03262; verl
    ``reinforce_plus_plus_baseline``), ``[B, T]``: ``r - mean_g`` (a group of one keeps its
    reward, as in verl), on every trained token, whitened over all trained tokens of the batch.
    Unlike GRPO a group with all-equal rewards is not zero after the global whitening."""
    mask = x.token_mask("reinforce_plus_plus_baseline")
    n = x.group_count()[x.index]
    centered = torch.where(n > 1, x.rewards - x.group_mean(), x.rewards)
    tiled = centered[:, None].expand(mask.shape)
    return _whiten(torch.where(mask, tiled, torch.zeros_like(tiled)), mask)


def gae_advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438), before any
    whitening: ``([B, T] advantages, [B, T] returns)``, 0 at untrained tokens.

    The outcome reward ``rewards[b]`` is the reward of trajectory ``b``'s last trained token;
    every other token's is 0, plus ``token_rewards`` (``[B, T]``, the KL in the reward) where
    given. Walking back over the trained tokens of each trajectory,
    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    ``next`` is the next *trained* token (0 past the last): an environment's tokens in a
    multi-turn trajectory are not steps of the policy and are skipped, as verl's
    ``compute_gae_advantage_return`` skips observation tokens. The returns, the critic's
    targets, are ``A_t + V_t``. float64 in, float64 out.
    """
    _, width = mask.shape
    step_rewards = _outcome_on_last(rewards, mask)
    if token_rewards is not None:
        step_rewards = step_rewards + torch.where(
            mask, token_rewards.to(step_rewards), torch.zeros_like(step_rewards)
        )
    next_value = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards)
    advantages = torch.zeros_like(step_rewards)
    for t in reversed(range(width)):
        trained = mask[:, t]
        delta = step_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = torch.where(trained, values[:, t], next_value)
        next_adv = torch.where(trained, adv_t, next_adv)
        advantages[:, t] = torch.where(trained, adv_t, torch.zeros_like(adv_t))
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def gae(x: AdvantageInputs) -> torch.Tensor:
    """PPO's advantages (Schulman et al. 2017; verl ``gae``, SkyRL ``gae``), ``[B, T]``: the
    critic's GAE (:func:`gae_advantages_and_returns`, ``algorithm.gamma``, ``algorithm.lam``)
    whitened over all trained tokens of the batch, as verl's ``masked_whiten``. The run trains
    a critic on the returns (``critic.*``)."""
    mask = x.token_mask("gae")
    advantages, _ = gae_advantages_and_returns(
        x.rewards, x.token_values("gae"), mask, x.gamma, x.lam, x.token_rewards
    )
    return _whiten(advantages, mask)
