"""Every objective on one hand-computed example (as verl's core_algos tests do).

The example: two sequences, old logprobs 0, so each token's ratio r = exp(logp) is chosen directly:
    sequence 0 (advantage +1): r = 1.5, 0.5, and a third token that is masked out (r = 3, must not count)
    sequence 1 (advantage -1): r = 1.1, 0.9, masked third token
"""

import math

import pytest
import torch

from k3.rl.losses import (ALGORITHMS, LossConfig, dynamic_sampling_keep, group_advantages, kl_k3, loss_config_for,
                          overlong_penalty, tis_weights)

RATIOS = [[1.5, 0.5, 3.0], [1.1, 0.9, 3.0]]
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


def run(name, **config):
    if name == "drgrpo":
        config.setdefault("norm_length", 4)
    logp = torch.tensor(RATIOS).log().requires_grad_(True)
    out = ALGORITHMS[name].loss(logp, torch.zeros(2, 3), ADV, MASK, loss_config_for(name, **config))
    out.loss.backward()
    out.loss = out.loss.detach()
    return out, logp.grad


def test_grpo():
    # token terms -min(rA, clip(r, 0.8, 1.2)A): seq 0: -1.2, -0.5; seq 1: +1.1, +0.9
    # per-sequence means -0.85 and 1.0, then their mean: 0.075. Clipped: only seq 0's first token (1 of 4).
    out, grad = run("grpo")
    assert float(out.loss) == pytest.approx(0.075, abs=1e-6)
    assert out.clip_fraction == pytest.approx(0.25)
    # d/dlogp of -r*A/(2*2) where unclipped: seq 0 token 1: -0.5/4; seq 1: 1.1/4, 0.9/4; clipped token: 0
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.125, 0.0, 0.275, 0.225, 0.0], abs=1e-6)


def test_drgrpo_divides_by_a_constant_length():
    # token terms as grpo, summed: -1.2 - 0.5 + 1.1 + 0.9 = 0.3; divided by B * norm_length = 2 * 4
    out, _ = run("drgrpo", norm_length=4)
    assert float(out.loss) == pytest.approx(0.0375, abs=1e-6)


def test_drgrpo_normaliser_does_not_follow_the_padded_length():
    """The same two sequences padded to another width (a micro-batch with a longer sequence, the next step)
    give the same Dr. GRPO loss: the normaliser is the configured constant, never the padded width T."""
    out, _ = run("drgrpo", norm_length=4)
    logp = torch.nn.functional.pad(torch.tensor(RATIOS).log(), (0, 5))
    wide = ALGORITHMS["drgrpo"].loss(logp, torch.zeros(2, 8), ADV, torch.nn.functional.pad(MASK, (0, 5)),
                                     loss_config_for("drgrpo", norm_length=4))
    assert float(wide.loss) == pytest.approx(float(out.loss), abs=1e-7)
    with pytest.raises(ValueError, match="constant length"):
        ALGORITHMS["drgrpo"].loss(logp, torch.zeros(2, 8), ADV, torch.nn.functional.pad(MASK, (0, 5)),
                                  loss_config_for("drgrpo"))


def test_dapo_clip_higher_and_token_mean():
    # eps_high 0.28: seq 0's first token clips at 1.28: (-1.28 - 0.5 + 1.1 + 0.9) / 4 tokens = 0.055
    out, _ = run("dapo")
    assert float(out.loss) == pytest.approx(0.055, abs=1e-6)
    assert out.clip_fraction == pytest.approx(0.25)


def test_gspo_sequence_ratio():
    # s0 = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75) = 0.866025; s1 = sqrt(0.99) = 0.994987.
    # Default band [1 - 3e-4, 1 + 4e-4]: seq 0 (A=+1) keeps min(0.866025, 0.9997) = 0.866025 -> -0.866025;
    # seq 1 (A=-1): min(-0.994987, -0.9997) = -0.9997 -> +0.9997 (clipped). Mean: 0.0668375.
    out, _ = run("gspo")
    assert float(out.loss) == pytest.approx((-math.sqrt(0.75) + 0.9997) / 2, abs=1e-6)
    assert float(out.loss) == pytest.approx(0.0668375, abs=1e-6)
    assert out.clip_fraction == pytest.approx(0.5)
    # With a wide band nothing clips: (-0.866025 + 0.994987) / 2 = 0.0644810
    wide, _ = run("gspo", clip_low=0.2, clip_high=0.2)
    assert float(wide.loss) == pytest.approx(0.0644810, abs=1e-6)


def test_cispo_keeps_every_token_gradient():
    # weights sg(clip(r, 0, 1.28)): 1.28, 0.5 | 1.1, 0.9; terms -w * A * logp with logp = ln r:
    # -1.28 * 0.405465 = -0.518995; -0.5 * -0.693147 = 0.346574; 1.1 * 0.095310 = 0.104841;
    # 0.9 * -0.105361 = -0.094825; token mean = -0.162405 / 4 = -0.0406012
    out, grad = run("cispo")
    assert float(out.loss) == pytest.approx(-0.0406012, abs=1e-6)
    # the clipped token still has a gradient (-1.28 / 4), unlike in grpo
    assert grad.flatten().tolist() == pytest.approx([-0.32, -0.125, 0.0, 0.275, 0.225, 0.0], abs=1e-6)


def test_pmd_squared_loss():
    # log(pi/pi_old) per sequence: ln 0.75 = -0.287682, ln 0.99 = -0.010050; tau = 0.1
    # (1 + 0.0287682)^2 = 1.058364; (-1 + 0.0010050)^2 = 0.997991; mean 1.028178
    out, _ = run("pmd")
    assert float(out.loss) == pytest.approx(1.028178, abs=1e-5)


def test_masked_tokens_never_matter():
    for name in ALGORITHMS:
        a, _ = run(name)
        logp = torch.tensor([[1.5, 0.5, 50.0], [1.1, 0.9, 1e-3]]).log()
        b = ALGORITHMS[name].loss(logp, torch.zeros(2, 3), ADV, MASK, loss_config_for(name, norm_length=4))
        assert float(a.loss) == pytest.approx(float(b.loss), abs=1e-6), name


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.866025
    assert group_advantages(rewards, "grpo").tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025],
                                                                      abs=1e-5)
    assert group_advantages(rewards, "drgrpo").tolist() == [0.5, -0.5, -0.5, 0.5]
    # Each objective's own advantage: Dr. GRPO drops GRPO's division by the group's std as well as the length.
    assert {name: algo.advantage for name, algo in ALGORITHMS.items()} == {
        "grpo": "grpo", "drgrpo": "drgrpo", "dapo": "grpo", "gspo": "grpo", "cispo": "grpo", "pmd": "mean"}
    assert group_advantages(torch.tensor([1.0, 1.0]), "grpo").tolist() == [0.0, 0.0]
    assert group_advantages(torch.tensor([1.0]), "grpo").tolist() == [0.0]


def test_dapo_dynamic_sampling_and_overlong_penalty():
    assert dynamic_sampling_keep([[0, 0, 0], [1, 1], [0, 1, 0]]) == [False, False, True]
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert overlong_penalty(120, 100, 20) == -1.0


def test_truncated_importance_weights_and_kl():
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[math.log(0.25), math.log(2.0), float("nan")]])
    # pi_old / pi_rollout = 4 (capped to 2), 0.5, unknown -> 1
    assert tis_weights(old, rollout, 2.0).flatten().tolist() == pytest.approx([2.0, 0.5, 1.0])
    assert tis_weights(old, rollout, None) is None
    # k3: exp(d) - d - 1 with d = ref - logp; d = ln 2: 2 - 0.693147 - 1 = 0.306853
    assert kl_k3(torch.zeros(1), torch.tensor([math.log(2.0)])).tolist() == pytest.approx([0.306853], abs=1e-6)
    assert float(kl_k3(torch.zeros(1), torch.zeros(1))) == 0.0


def test_unknown_algorithm_lists_the_known():
    with pytest.raises(ValueError, match="choose one of"):
        loss_config_for("ppo2")
    assert LossConfig().tis_cap == 2.0
