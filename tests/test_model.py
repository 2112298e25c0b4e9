import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig


def make(preset="debug", dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    config = ModelConfig.from_preset(preset, **overrides)
    model = K3ForCausalLM(config).to(dtype)
    # Random (non-zero) pseudo-queries so AttnRes mixtures are not trivially uniform.
    for name, p in model.named_parameters():
        if name.endswith("res.proj.weight"):
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


VARIANTS = {
    "k3-debug": {},
    "plain-residuals-softplus-lowrank": dict(attn_res_block_size=0, kda_gate="softplus", kda_output_gate="low_rank",
                                             mla_output_gate=False, q_lora_rank=None, moe_latent_size=None,
                                             hidden_act="silu"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_pieces_equal_full_forward(variant):
    model = make(**VARIANTS[variant])
    ids = torch.randint(0, model.config.vocab_size, (2, 41))
    full = model(ids).logits
    cache = model.new_cache(2)
    pieces = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 19), (19, 20), (20, 21), (21, 41)]]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.seen_tokens == 41


def test_one_token_at_a_time_equals_full_forward():
    model = make()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    full = model(ids).logits
    cache = model.new_cache(2)
    steps = [model(ids[:, t:t + 1], cache=cache).logits for t in range(24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_absorbed_mla_decode_equals_expanded():
    model = make()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    outputs = []
    for absorb in (True, False):
        for layer in model.model.layers:
            if layer.attention_type == "mla":
                layer.self_attn.absorb_in_decode = absorb
        cache = model.new_cache(1)
        outputs.append(torch.cat([model(ids[:, :9], cache=cache).logits,
                                  model(ids[:, 9:], cache=cache).logits], 1))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)


def test_packed_documents_do_not_leak():
    model = make()
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    cu = torch.tensor([0, 7, 8, 30, 40])
    packed = model(ids, cu_seqlens=cu).logits
    separate = torch.cat([model(ids[:, a:b]).logits for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    torch.testing.assert_close(packed, separate, rtol=1e-6, atol=1e-6)


def test_kda_cache_is_constant_in_context_length():
    model = make()
    cache = model.new_cache(1)
    model(torch.randint(0, 256, (1, 10)), cache=cache)
    kda_small, mla_small = cache.nbytes("kda"), cache.nbytes("mla")
    model(torch.randint(0, 256, (1, 90)), cache=cache)
    assert cache.nbytes("kda") == kda_small
    config = model.config
    per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * 8 * config.layer_types.count("mla")
    assert cache.nbytes("mla") == mla_small + 90 * per_token


def test_zero_pseudo_queries_start_uniform():
    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    res = [p for n, p in model.named_parameters() if n.endswith("res.proj.weight")]
    assert len(res) == 2 * model.config.num_layers + 1
    assert all(torch.count_nonzero(p) == 0 for p in res)


def test_bad_inputs_are_rejected_clearly():
    model = make()
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[1, 2, 999]]))
    with pytest.raises(ValueError, match="batch"):
        model(torch.tensor([[1, 2]]), cache=model.new_cache(3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.tensor([[1, 2, 3]]), cu_seqlens=torch.tensor([0, 2]))


def test_debug_model_trains_and_balances():
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable stream: repeated random phrases.
    phrases = torch.randint(0, 256, (8, 16))
    data = phrases[torch.randint(0, 8, (2, 4))].reshape(2, 64)
    losses = []
    for _ in range(25):
        out = model(data[:, :-1], labels=data[:, 1:])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_balancers()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert set(model.moe_maxvio()) == {1, 2, 3}
    biases = [r.e_score_correction_bias for _, r in model.routers()]
    assert all(torch.count_nonzero(b) > 0 for b in biases)  # QB moved the selection biases



def test_per_document_attention_leaves_out_cudnn(monkeypatch):
    """Packed documents: each document's SDPA call runs with cuDNN's backend disabled (it builds a plan per new
    shape: k3.layers.mla.PER_DOCUMENT_BACKENDS); an unpacked forward keeps PyTorch's own choice."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or real(*a, **k))
    model = make()
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        model(ids, cu_seqlens=torch.tensor([0, 7, 8, 30, 40]))
    mla_layers = sum(layer.attention_type == "mla" for layer in model.model.layers)
    assert seen == [False] * 4 * mla_layers  # four documents per MLA layer
    seen.clear()
    with torch.no_grad():
        model(ids)
    assert seen == [torch.backends.cuda.cudnn_sdp_enabled()] * mla_layers
