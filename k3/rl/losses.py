"""Policy objectives for RL from verifiable rewards: each a small registered function with one signature,
picked by name (``ALGORITHMS[name]``), as verl's core_algos does.

    loss_fn(logp_BT, old_logp_BT, adv_B, mask_BT, config, weights_BT=None) -> LossOutput

    logp_BT      log pi_theta(token) of the policy being trained, [B, T] (B sequences padded to T), with grad
    old_logp_BT  log pi_old(token) of the policy that sampled (recomputed by the trainer), [B, T], no grad
    adv_B        one advantage per sequence (outcome reward, group-normalised per the algorithm), [B]
    mask_BT      1 for tokens the policy produced (tool output, prompt and padding are 0), [B, T]
    weights_BT   truncated importance weights against the rollout engine's logprobs, [B, T], no grad
                 (None: all 1); see tis_weights

Objectives (negated: they are minimised):
    grpo    token ratio r = pi/pi_old clipped to [1-eps_low, 1+eps_high]; -min(rA, clip(r)A); mean over each
            sequence's tokens, then over sequences. Advantage (r - mean) / std in the group.
    drgrpo  Dr. GRPO: the same token term; summed and divided by B * norm_length, a constant (k3 rl: the
            configured max_context), not a sequence's or the micro-batch's padded length, which change from
            step to step and would rescale the update with them; advantage r - mean (no std).
    dapo    the token term with clip-higher (eps_high 0.28 > eps_low 0.2), averaged over all tokens of the
            batch (token-mean). Dynamic sampling (dynamic_sampling_keep) and the overlong penalty
            (overlong_penalty) are its other two parts.
    gspo    sequence ratio s = exp(mean_t log(pi/pi_old)) clipped to [1-3e-4, 1+4e-4]; -min(sA, clip(s)A),
            mean over sequences. Stable for MoE without routing replay.
    cispo   CISPO: every token keeps its gradient: -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi, token-mean.
    pmd     Kimi k1.5 policy mirror descent: (r - mean(r) - tau * log(pi(y)/pi_old(y)))^2, mean over the group;
            log pi(y) is the sum over the sequence's tokens. No clipping, no value network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LossConfig:
    """The policy loss's settings; each field's docstring is its `k3 rl` --help text."""

    clip_low: float = 0.2
    """lower clip of the importance ratio, 1 - clip_low (default: the algorithm's published value)"""
    clip_high: float = 0.2
    """upper clip of the importance ratio, 1 + clip_high (default: the algorithm's published value)"""
    tau: float = 0.1
    """pmd: the KL strength"""
    norm_length: int | None = None
    """drgrpo: the constant length it divides by (required by drgrpo)"""
    tis_cap: float | None = 2.0
    """truncated importance sampling cap (default 2; None: off)"""
    kl_coef: float = 0.0
    """KL to the frozen starting policy, the k3 estimate's weight (default 0: no reference)"""


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, with grad
    clip_fraction: float  # share of (masked) tokens, or sequences for gspo, whose term was clipped


LossFn = Callable[..., LossOutput]


@dataclass(frozen=True)
class Algorithm:
    loss: LossFn
    advantage: str  # "grpo" | "drgrpo" | "mean"
    defaults: dict


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def seq_mean_token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    per_seq = (values_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    return per_seq.mean()


def _clipped_token_term(logp_BT, old_logp_BT, adv_B, mask_BT, config) -> tuple[torch.Tensor, float]:
    ratio = torch.exp(logp_BT - old_logp_BT)
    adv = adv_B[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * adv
    term = -torch.minimum(unclipped, clipped)
    active = ((clipped < unclipped).float() * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    return term, float(active)


def _weighted(term_BT, weights_BT):
    return term_BT if weights_BT is None else term_BT * weights_BT


def grpo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, config: LossConfig, weights_BT=None) -> LossOutput:
    term, clipped = _clipped_token_term(logp_BT, old_logp_BT, adv_B, mask_BT, config)
    return LossOutput(seq_mean_token_mean(_weighted(term, weights_BT), mask_BT), clipped)


def drgrpo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, config: LossConfig, weights_BT=None) -> LossOutput:
    if not config.norm_length or config.norm_length < 1:
        raise ValueError(f"drgrpo divides by a constant length: set LossConfig.norm_length to a positive number "
                         f"of tokens (k3 rl uses max_context), got {config.norm_length!r}")
    term, clipped = _clipped_token_term(logp_BT, old_logp_BT, adv_B, mask_BT, config)
    length = config.norm_length
    return LossOutput((_weighted(term, weights_BT) * mask_BT).sum() / (mask_BT.shape[0] * length), clipped)


def dapo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, config: LossConfig, weights_BT=None) -> LossOutput:
    term, clipped = _clipped_token_term(logp_BT, old_logp_BT, adv_B, mask_BT, config)
    return LossOutput(masked_mean(_weighted(term, weights_BT), mask_BT), clipped)


def _sequence_weights(weights_BT, mask_BT):
    if weights_BT is None:
        return None
    return (weights_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)


def gspo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, config: LossConfig, weights_BT=None) -> LossOutput:
    log_ratio_B = ((logp_BT - old_logp_BT) * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    ratio_B = torch.exp(log_ratio_B)
    unclipped = ratio_B * adv_B
    clipped = ratio_B.clamp(1 - config.clip_low, 1 + config.clip_high) * adv_B
    term_B = -torch.minimum(unclipped, clipped)
    seq_weights = _sequence_weights(weights_BT, mask_BT)
    if seq_weights is not None:
        term_B = term_B * seq_weights
    return LossOutput(term_B.mean(), float((clipped < unclipped).float().mean()))


def cispo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, config: LossConfig, weights_BT=None) -> LossOutput:
    ratio = torch.exp(logp_BT - old_logp_BT).detach()
    kept = ratio.clamp(max(0.0, 1 - config.clip_low), 1 + config.clip_high)
    term = -kept * adv_B[:, None] * logp_BT
    clipped = float((((ratio > 1 + config.clip_high) | (ratio < 1 - config.clip_low)).float() * mask_BT).sum()
                    / mask_BT.sum().clamp(min=1))
    return LossOutput(masked_mean(_weighted(term, weights_BT), mask_BT), clipped)


def pmd_loss(logp_BT, old_logp_BT, adv_B, mask_BT, config: LossConfig, weights_BT=None) -> LossOutput:
    log_ratio_B = ((logp_BT - old_logp_BT) * mask_BT).sum(-1)
    term_B = (adv_B - config.tau * log_ratio_B) ** 2
    seq_weights = _sequence_weights(weights_BT, mask_BT)
    if seq_weights is not None:
        term_B = term_B * seq_weights
    return LossOutput(term_B.mean(), 0.0)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(grpo_loss, "grpo", {"clip_low": 0.2, "clip_high": 0.2}),
    "drgrpo": Algorithm(drgrpo_loss, "drgrpo", {"clip_low": 0.2, "clip_high": 0.2}),
    "dapo": Algorithm(dapo_loss, "grpo", {"clip_low": 0.2, "clip_high": 0.28}),
    "gspo": Algorithm(gspo_loss, "grpo", {"clip_low": 3e-4, "clip_high": 4e-4}),
    "cispo": Algorithm(cispo_loss, "grpo", {"clip_low": 1.0, "clip_high": 0.28}),
    "pmd": Algorithm(pmd_loss, "mean", {"tau": 0.1}),
}


def loss_config_for(algorithm: str, **overrides) -> LossConfig:
    """The algorithm's published defaults, then ``overrides`` (None values are ignored)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown RL algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    fields = {**ALGORITHMS[algorithm].defaults, **{k: v for k, v in overrides.items() if v is not None}}
    return dataclasses.replace(LossConfig(), **fields)


def group_advantages(rewards_G: torch.Tensor, kind: str, eps: float = 1e-6) -> torch.Tensor:
    """rewards of one group [G] -> advantages [G]. grpo: (r - mean) / (std + eps) with the unbiased std (0 for
    a group of one); drgrpo and mean: r - mean."""
    centred = rewards_G - rewards_G.mean()
    if kind == "grpo":
        std = rewards_G.std() if rewards_G.numel() > 1 else torch.zeros(())
        return centred / (std + eps)
    if kind in ("drgrpo", "mean"):
        return centred
    raise ValueError(f"unknown advantage kind {kind!r}; use grpo, drgrpo or mean")


def dynamic_sampling_keep(group_rewards: list[list[float]]) -> list[bool]:
    """DAPO's dynamic sampling: keep a group only when its rewards are not all equal (all-0 and all-1 groups
    give zero advantage everywhere and only dilute the batch)."""
    return [len(set(rewards)) > 1 for rewards in group_rewards]


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_length - cache_length, then falling
    linearly to -1 at max_length, and -1 beyond."""
    if length <= max_length - cache_length:
        return 0.0
    if length <= max_length:
        return ((max_length - cache_length) - length) / cache_length
    return -1.0


def tis_weights(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """Truncated importance sampling for the train/inference mismatch: min(pi_old / pi_rollout, cap) per
    token, where the rollout engine's logprob is known (NaN positions get weight 1). None when cap is None."""
    if cap is None:
        return None
    known = torch.isfinite(rollout_logp_BT)
    ratio = torch.exp(old_logp_BT - torch.where(known, rollout_logp_BT, old_logp_BT))
    return ratio.clamp(max=cap).detach()


def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    delta = ref_logp_BT - logp_BT
    return torch.exp(delta) - delta - 1
