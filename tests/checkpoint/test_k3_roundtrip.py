"""Kimi-K3 layout: our exporter writes it (sharded, MXFP4 experts), our loader reads it back."""

from __future__ import annotations

import copy
import filecmp
import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3.checkpoint.hf import from_pretrained, load_hf_tokenizer, save_pretrained
from k3.checkpoint.mxfp4 import fake_quantize_mxfp4
from k3.config import ModelConfig
from k3.layers.attn_res import AttnResMix
from k3.layers.moe import LatentMoE
from k3.model import K3ForCausalLM


def _k3_model(dtype: torch.dtype = torch.bfloat16, **overrides) -> K3ForCausalLM:
    """The debug preset (every K3 feature on) with a K3-style A_log longer than the head count, and AttnRes
    pseudo-queries and routing biases moved off their zero init so that they matter."""
    config = ModelConfig.from_preset("debug", kda_a_log_size=4, **overrides)
    model = K3ForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AttnResMix):
                module.proj.weight.normal_(0.0, 0.5)
                module.norm.weight.add_(torch.randn_like(module.norm.weight) * 0.1)
        for _, router in model.routers():
            router.e_score_correction_bias.normal_(0.0, 0.05)
    return model.to(dtype)


def _quantised_copy(model: K3ForCausalLM) -> K3ForCausalLM:
    """The model with each expert matrix replaced by its MXFP4 round trip (what the checkpoint holds)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, LatentMoE):
                for weight in (module.w1, module.w2, module.w3):
                    for e in range(weight.shape[0]):
                        weight[e] = fake_quantize_mxfp4(weight[e])
    return reference


def test_mxfp4_k3_checkpoint_round_trip(tmp_path):
    model = _k3_model()
    path = save_pretrained(model, None, tmp_path / "k3", format="kimi_k3", mxfp4_experts=True,
                           max_shard_size="60KB", progress=False)
    files = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and "text_config" in config
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(name.startswith("language_model.") for name in index)
    packed = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    with safe_open(str(path / index[packed]), "pt") as handle:
        tensor = handle.get_tensor(packed)
    latent, width = model.config.moe_latent_size, model.config.moe_intermediate_size
    assert tensor.dtype == torch.uint8 and tuple(tensor.shape) == (latent, width // 2)
    assert "language_model.model.layers.0.self_attention_res_proj.weight" in index
    assert "language_model.model.output_attn_res_norm.weight" in index

    loaded = from_pretrained(path, progress=False)
    tokenizer = load_hf_tokenizer(path, required=False)
    assert tokenizer is None and not loaded.training
    reference = _quantised_copy(model)
    # Dequantised weights equal the quantised-then-dequantised original exactly; all else is copied exactly.
    for key, value in reference.state_dict().items():
        got = loaded.state_dict()[key]
        assert got.dtype == value.dtype and torch.equal(got, value), key

    ids = torch.randint(0, model.config.vocab_size, (2, 13))
    with torch.no_grad():
        original = model(ids).logits.float()
        ours = loaded(ids).logits.float()
        assert torch.equal(ours, reference(ids).logits.float())
    # Within MXFP4 error of the bf16 original: close, and not identical (the experts really were quantised).
    relative = ((ours - original).norm() / original.norm()).item()
    assert 0 < relative < 0.1, relative

    # Second round trip: byte-identical files.
    again = save_pretrained(loaded, None, tmp_path / "k3_again", format="kimi_k3", mxfp4_experts=True,
                            max_shard_size="60KB", progress=False)
    assert sorted(os.listdir(again)) == files
    assert all(filecmp.cmp(path / f, again / f, shallow=False) for f in files)


def test_bf16_k3_round_trip_is_exact_and_overwrites_atomically(tmp_path):
    model = _k3_model(tie_word_embeddings=False)
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.txt").write_text("old checkpoint")
    save_pretrained(model, None, target, format="kimi_k3", progress=False)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "staging directories left behind"
    loaded = from_pretrained(target, progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.config.to_dict() == model.config.to_dict()


def test_published_extras_are_skipped_and_older_attn_res_spelling_loads(tmp_path):
    """Vision tower, projector and MTP tensors are dropped; `self_attention_res.proj_weight` [d] also loads."""
    model = _k3_model()
    path = save_pretrained(model, None, tmp_path / "k3", format="kimi_k3", progress=False)
    state = load_file(str(path / "model.safetensors"))
    for old, new in (("self_attention_res_proj.weight", "self_attention_res.proj_weight"),
                     ("self_attention_res_norm.weight", "self_attention_res.norm_weight")):
        for name in [n for n in state if n.endswith(old)]:
            value = state.pop(name)
            state[name[: -len(old)] + new] = value.reshape(-1)
    state["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
    state["mm_projector.proj.0.weight"] = torch.zeros(2, 2)
    state["language_model.model.mtp.layers.0.eh_proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(path / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be reported as unused
        loaded = from_pretrained(path, progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_dtype_argument_casts_but_keeps_gate_parameters_fp32(tmp_path):
    model = _k3_model(dtype=torch.float32)
    path = save_pretrained(model, None, tmp_path / "k3", format="kimi_k3", mxfp4_experts=True, progress=False)
    loaded = from_pretrained(path, dtype="bfloat16", progress=False)
    dtypes = {name: t.dtype for name, t in loaded.state_dict().items()}
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.block_sparse_moe.w1"] == torch.bfloat16
    assert dtypes["model.layers.0.self_attn.A_log"] == torch.float32
    assert dtypes["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == torch.float32


def test_kimi_linear_format_refuses_k3_only_models(tmp_path):
    with pytest.raises(ValueError, match="kimi_k3"):
        save_pretrained(_k3_model(), None, tmp_path / "x", format="kimi_linear", progress=False)
    assert not (tmp_path / "x").exists()
