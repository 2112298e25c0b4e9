"""The trainer side: masks (tool tokens get no gradient), routing replay, and the update itself."""

import math

import pytest
import torch

from k3.rl.chat_format import render_ids
from k3.rl.losses import ALGORITHMS, loss_config_for
from k3.rl.policy import PolicyConfig, PolicyUpdater, Sequence, micro_batches, packed_logprobs, token_logprobs
from k3.rl.routing import RoutingReplay

MESSAGES = [{"role": "user", "content": "Compute 12+30."},
            {"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {"code": "print(12+30)"}}'
                                             '</tool_call>'},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": '<tool_call>{"name": "submit", "arguments": {"answer": "42"}}</tool_call>'}]


def test_masked_tool_tokens_get_no_gradient(tiny_model, tokenizer):
    ids, mask = render_ids(MESSAGES, tokenizer)
    ids_T = torch.tensor(ids)
    logits = tiny_model(ids_T[None]).logits[0].detach().requires_grad_(True)
    logp = token_logprobs(logits, ids_T)
    mask_T = torch.tensor(mask, dtype=torch.float32)
    for name in ALGORITHMS:
        logits.grad = None
        out = ALGORITHMS[name].loss(logp[None], logp.detach()[None], torch.tensor([1.0]), mask_T[None],
                                    loss_config_for(name, norm_length=64))
        out.loss.backward(retain_graph=True)
        # logits row t predicts token t+1: its gradient is zero exactly when token t+1 is not trainable
        row_has_grad = logits.grad.abs().sum(-1) > 0
        assert row_has_grad[:-1].tolist() == mask[1:], name
        assert not row_has_grad[-1]
    assert 0 < sum(mask) < len(mask) - 10  # the example has tool and prompt tokens to mask


def test_routing_replay_reuses_the_recorded_experts(tiny_model, tokenizer):
    ids, _ = render_ids(MESSAGES, tokenizer)
    batch = torch.tensor(ids)[None]
    replay = RoutingReplay(tiny_model)
    assert len(replay.routers) == 3  # debug: the first layer is dense
    with replay.record() as recorded:
        before = tiny_model(batch).logits
    # Unchanged weights: replaying gives the very same forward.
    with replay.replay(recorded):
        again = tiny_model(batch).logits
    torch.testing.assert_close(again, before, rtol=0, atol=0)
    # Move every router: left alone, tokens pick other experts ...
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn_like(router.weight) * 5)
    with replay.record() as moved:
        tiny_model(batch)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(recorded, moved))
    # ... under replay they keep the recorded ones, and the router still gets a gradient through the gates.
    with replay.replay(recorded), replay.record() as replayed:
        loss = tiny_model(batch).logits.float().logsumexp(-1).mean()
    for a, b in zip(recorded, replayed):
        assert len(a) == len(b) == 1 and torch.equal(a[0], b[0])
    loss.backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0 for router in replay.routers)


def test_replay_refuses_another_token_layout(tiny_model, tokenizer):
    replay = RoutingReplay(tiny_model)
    with replay.record() as recorded:
        tiny_model(torch.tensor([[1, 2, 3]]))
    try:
        with replay.replay(recorded):
            tiny_model(torch.tensor([[1, 2, 3, 4]]))
    except RuntimeError as error:
        assert "same token layout" in str(error)
    else:
        raise AssertionError("replay over a different layout must fail")


def test_packed_logprobs_equal_one_sequence_at_a_time(tiny_model, tokenizer):
    a, _ = render_ids(MESSAGES, tokenizer)
    b, _ = render_ids(MESSAGES[:2], tokenizer)
    packed, _ = packed_logprobs(tiny_model, [a, b], torch.device("cpu"))
    for ids, got in zip([a, b], packed):
        alone = token_logprobs(tiny_model(torch.tensor([ids])).logits[0], torch.tensor(ids))
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-5)
    assert micro_batches([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]


def test_update_raises_the_logprob_of_rewarded_tokens_and_ignores_masked_ones(tiny_model, tokenizer):
    ids, mask = render_ids(MESSAGES, tokenizer)
    good = Sequence(ids, mask, [float("nan")] * len(ids), advantage=1.0)
    updater = PolicyUpdater(tiny_model, PolicyConfig(algorithm="grpo", lr=3e-3), loss_config_for("grpo"))
    biases = [router.e_score_correction_bias.clone() for _, router in tiny_model.routers()]

    def trained_logprob():
        with torch.no_grad():
            logp, _ = packed_logprobs(tiny_model, [ids], torch.device("cpu"))
        return float((logp[0] * torch.tensor(mask, dtype=torch.float32)).sum())

    start = trained_logprob()
    for _ in range(3):
        metrics = updater.update([good])
    assert trained_logprob() > start + 1.0
    assert metrics["trained_tokens"] == sum(mask) and metrics["logprob_gap"] != metrics["logprob_gap"]  # NaN: unknown
    # Quantile Balancing's bias stays frozen during RL by default.
    for before, (_, router) in zip(biases, tiny_model.routers()):
        assert torch.equal(before, router.e_score_correction_bias)
    # A sequence with nothing trainable changes no weight.
    weights = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    PolicyUpdater(tiny_model, PolicyConfig(algorithm="grpo", lr=3e-3), loss_config_for("grpo")).update(
        [Sequence(ids, [False] * len(ids), [0.0] * len(ids), advantage=1.0)])
    assert all(torch.equal(weights[n], p) for n, p in tiny_model.named_parameters())


def test_a_filler_document_pads_the_packed_row_and_changes_nothing(tiny_model, tokenizer):
    """GPU runs pad each packed micro-batch to a multiple of a few thousand tokens (so kernels compile for a
    few lengths); the filler is its own document, so the real tokens' logprobs, the routing replay and the
    update are those of the unpadded row."""
    import copy

    from k3.data.packing import filler_length

    assert [filler_length(n, 64) for n in (1, 64, 65, 128)] == [63, 0, 63, 0]
    assert filler_length(37, 0) == 0
    a, mask_a = render_ids(MESSAGES, tokenizer)
    b, mask_b = render_ids(MESSAGES[:2], tokenizer)
    plain, _ = packed_logprobs(tiny_model, [a, b], torch.device("cpu"))
    padded, _ = packed_logprobs(tiny_model, [a, b], torch.device("cpu"), filler=filler_length(len(a) + len(b), 64))
    assert len(padded) == 2
    for got, want in zip(padded, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the whole update: the same sequences (rollout routing recorded for the first), with and without padding
    replay = RoutingReplay(tiny_model)
    with replay.record() as recorded:
        tiny_model(torch.tensor([a]))
    routing = torch.stack([calls[0] for calls in recorded])  # [MoE layers, len(a), K]
    sequences = [Sequence(a, mask_a, [float("nan")] * len(a), advantage=1.0, routing=routing),
                 Sequence(b, mask_b, [float("nan")] * len(b), advantage=-1.0)]
    results = []
    for multiple in (0, 64):
        model = copy.deepcopy(tiny_model)
        config = PolicyConfig(algorithm="grpo", lr=3e-3, pack_multiple=multiple)
        metrics = PolicyUpdater(model, config, loss_config_for("grpo")).update(sequences)
        results.append((metrics, {n: p.detach() for n, p in model.named_parameters()}))
    (plain_metrics, plain_weights), (padded_metrics, padded_weights) = results
    assert padded_metrics["rollout_routed_share"] == plain_metrics["rollout_routed_share"] > 0
    for key in ("loss", "entropy", "grad_norm", "trained_tokens"):
        assert abs(padded_metrics[key] - plain_metrics[key]) <= 1e-5 * max(1.0, abs(plain_metrics[key])), key
    for name, weight in plain_weights.items():
        torch.testing.assert_close(padded_weights[name], weight, rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.equal(w, tiny_model.state_dict()[n]) for n, w in plain_weights.items())  # it did train


class FixedLogits(torch.nn.Module):
    """Logits (2, 0, -1) at every position, whatever the tokens."""

    def forward(self, ids, cu_seqlens=None):
        from types import SimpleNamespace

        return SimpleNamespace(logits=torch.tensor([2.0, 0.0, -1.0]).expand(1, ids.shape[1], 3))


def test_trainer_logprobs_at_the_sampling_temperature_equal_a_hand_computation():
    # at T = 0.5 the logits are (4, 0, -2): log p = z - log(e^4 + e^0 + e^-2) = z - 4.0205811
    logps, entropies = packed_logprobs(FixedLogits(), [[0, 0, 2], [1, 1]], torch.device("cpu"), with_entropy=True,
                                       temperature=0.5)
    assert logps[0].tolist() == pytest.approx([0.0, 4 - 4.0205811, -2 - 4.0205811], abs=1e-6)
    assert logps[1].tolist() == pytest.approx([0.0, 0 - 4.0205811], abs=1e-6)
    p = [math.exp(z - 4.0205811) for z in (4, 0, -2)]
    assert entropies[1][1].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)
    at_one, _ = packed_logprobs(FixedLogits(), [[0, 0]], torch.device("cpu"))  # temperature 1: the model's own
    assert at_one[0][1].item() == pytest.approx(2 - math.log(math.exp(2) + 1 + math.exp(-1)), abs=1e-6)


def test_one_minibatch_takes_old_logprobs_from_the_training_forward_itself(tiny_model, tokenizer):
    """With one mini-batch the old logprobs are the training forward's own, detached: bit for bit, even where a
    no-grad forward would compute something else (on CUDA, kernels picked by grad mode). Here the model is made
    to differ without grad; the first ratio is still exactly 1 and GSPO's narrow band clips nothing."""
    import dataclasses

    tiny_model.lm_head.register_forward_hook(
        lambda module, args, out: out if torch.is_grad_enabled() else out + 1e-3 * torch.linspace(0, 1, out.shape[-1]))
    ids, mask = render_ids(MESSAGES, tokenizer)
    short, short_mask = render_ids(MESSAGES[:2], tokenizer)
    sequences = [Sequence(ids, mask, [float("nan")] * len(ids), advantage=1.0),
                 Sequence(short, short_mask, [float("nan")] * len(short), advantage=-1.0)]
    updater = PolicyUpdater(tiny_model, PolicyConfig(algorithm="gspo", lr=1e-3, temperature=0.7),
                            loss_config_for("gspo"))
    seen = []

    def recording(logp_BT, old_logp_BT, adv_B, mask_BT, config, weights_BT=None):
        seen.append((logp_BT.detach().clone(), old_logp_BT.clone()))
        return ALGORITHMS["gspo"].loss(logp_BT, old_logp_BT, adv_B, mask_BT, config, weights_BT)

    updater.algorithm = dataclasses.replace(updater.algorithm, loss=recording)
    metrics = updater.update(sequences)
    assert seen and all(torch.equal(new, old) for new, old in seen)
    assert metrics["clip_fraction"] == 0.0


def test_with_two_minibatches_the_first_is_on_policy_ratio_one_nothing_clipped(tiny_model, tokenizer):
    """With several mini-batches the old logprobs come from a pass of their own, in grad mode like the training
    pass (on CUDA kernels are chosen by grad mode): here the model is made to differ without grad, and the first
    mini-batch's ratio is still exactly 1, GSPO clips nothing there (both reported per step)."""
    tiny_model.lm_head.register_forward_hook(
        lambda module, args, out: out if torch.is_grad_enabled() else out + 1e-3 * torch.linspace(0, 1, out.shape[-1]))
    ids, mask = render_ids(MESSAGES, tokenizer)
    short, short_mask = render_ids(MESSAGES[:2], tokenizer)
    sequences = [Sequence(ids, mask, [float("nan")] * len(ids), advantage=1.0),
                 Sequence(short, short_mask, [float("nan")] * len(short), advantage=-1.0),
                 Sequence(ids, mask, [float("nan")] * len(ids), advantage=-1.0),
                 Sequence(short, short_mask, [float("nan")] * len(short), advantage=1.0)]
    updater = PolicyUpdater(tiny_model, PolicyConfig(algorithm="gspo", lr=1e-2, minibatches=2),
                            loss_config_for("gspo"))
    metrics = updater.update(sequences)
    assert metrics["first_minibatch_ratio_max_dev"] == 0.0
    assert metrics["first_minibatch_clip_fraction"] == 0.0
    assert metrics["clip_fraction"] > 0.0  # the second mini-batch, after a large step, is off-policy and clips
