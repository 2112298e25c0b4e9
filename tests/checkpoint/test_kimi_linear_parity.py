"""Kimi-Linear parity: a transformers KimiLinearForCausalLM with random weights, saved with save_pretrained,
loads into k3 and gives the same logits and the same greedy continuation (k3's cached decode vs transformers'
generate). Also the other direction (k3 writes kimi_linear, transformers reads it) and transformers'
in-memory tensor layout (fused conv1d, gate_up_proj)."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3.checkpoint.hf import from_pretrained, load_hf_tokenizer, save_pretrained  # noqa: E402

VOCAB = 96

# Several layer patterns, with and without q_lora_rank, two MoE sizes (experts, top-k, shared, widths).
CONFIGS = {
    "mla-even_no-qlora": dict(
        num_hidden_layers=4, q_lora_rank=None, full_attn_layers=[2, 4], first_k_dense_replace=1,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32),
    "mla-last_qlora": dict(
        num_hidden_layers=3, q_lora_rank=24, full_attn_layers=[3], first_k_dense_replace=0,
        num_local_experts=6, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=24),
    "mla-first-and-last_qlora_two-dense": dict(
        num_hidden_layers=5, q_lora_rank=16, full_attn_layers=[1, 5], first_k_dense_replace=2,
        num_local_experts=4, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=48),
}


def _hf_config(spec: dict) -> KimiLinearConfig:
    spec = dict(spec)
    layers = spec.pop("num_hidden_layers")
    full = spec.pop("full_attn_layers")
    kda = [i for i in range(1, layers + 1) if i not in full]
    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4,
                                               full_attn_layers=full, kda_layers=kda),
        routed_scaling_factor=2.446, pad_token_id=0, bos_token_id=1, eos_token_id=None, **spec)


def _random_hf_model(spec: dict) -> KimiLinearForCausalLM:
    """transformers' own init, then every tensor perturbed so that a swapped or transposed tensor shows
    (norm gains away from 1, a non-zero routing bias)."""
    model = KimiLinearForCausalLM(_hf_config(spec)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.1)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.2)
            elif name.endswith(("A_log", "dt_bias")):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
            else:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.01)
    return model


def _quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*falling back.*")


def _greedy_k3(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill with a cache, then one token at a time."""
    cache = model.new_cache(prompt.shape[0])
    logits = model(prompt, cache=cache).logits
    out = [prompt]
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        logits = model(token, cache=cache).logits
    return torch.cat(out, dim=1)


def _assert_logits_match(reference: torch.Tensor, ours: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    diff = (reference - ours).abs().max().item()
    assert diff <= 1e-4 * scale, f"max |diff| {diff:.3g} exceeds 1e-4 of the logit scale {scale:.3g}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_checkpoint_gives_same_logits_and_greedy_continuation(name, tmp_path):
    _quiet()
    hf_model = _random_hf_model(CONFIGS[name])
    hf_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf", progress=False)
    tokenizer = load_hf_tokenizer(tmp_path / "hf", required=False)
    assert tokenizer is None
    assert model.config.layer_types == ["mla" if t == "full_attention" else "kda"
                                        for t in hf_model.config.layer_types]

    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        _assert_logits_match(hf_model(ids).logits, model(ids).logits)
        prompt = ids[:1, :7]
        # An explicit mask: otherwise generate treats prompt tokens equal to pad_token_id as padding.
        expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(_greedy_k3(model, prompt, 8), expected)


def test_transformers_in_memory_layout_loads(tmp_path):
    """transformers' runtime names (fused conv1d, forget_gate.*, mlp.experts.gate_up_proj) load the same."""
    _quiet()
    from safetensors.torch import save_file

    hf_model = _random_hf_model(CONFIGS["mla-last_qlora"])
    hf_model.save_pretrained(tmp_path / "moonshot")
    (tmp_path / "fused").mkdir()
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("self_attn.conv1d.weight") for k in state)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "moonshot" / "config.json").read_text())
    fused = from_pretrained(tmp_path / "fused", progress=False)
    moonshot = from_pretrained(tmp_path / "moonshot", progress=False)
    for key, value in moonshot.state_dict().items():
        assert torch.equal(value, fused.state_dict()[key]), key


def test_k3_export_loads_in_transformers(tmp_path):
    """k3 -> kimi_linear directory -> transformers: same logits; and k3 reads its own export back exactly."""
    _quiet()
    hf_model = _random_hf_model(CONFIGS["mla-even_no-qlora"])
    hf_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf", progress=False)
    save_pretrained(model, None, tmp_path / "k3_export", format="kimi_linear", progress=False)
    config = json.loads((tmp_path / "k3_export" / "config.json").read_text())
    assert config["model_type"] == "kimi_linear"
    reloaded_hf = KimiLinearForCausalLM.from_pretrained(tmp_path / "k3_export").eval()
    ids = torch.randint(0, VOCAB, (1, 11))
    with torch.no_grad():
        _assert_logits_match(hf_model(ids).logits, reloaded_hf(ids).logits)
    again = from_pretrained(tmp_path / "k3_export", progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    # The K3 wrapper can carry a Kimi-Linear model too: same config, same tensors.
    save_pretrained(model, None, tmp_path / "as_k3", format="kimi_k3", progress=False)
    as_k3 = from_pretrained(tmp_path / "as_k3", progress=False)
    assert as_k3.config.to_dict() == model.config.to_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, as_k3.state_dict()[key]), key
