"""The published key layout of the vision part: K3 and Kimi-K2.5 round trips through HF directories, config.json
spellings, and clear errors for directories that do not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.checkpoint.hf import from_pretrained as text_from_pretrained
from k3.checkpoint.hf import save_pretrained as text_save
from k3.config import ModelConfig
from k3.checkpoint.hf_multimodal import from_pretrained, save_pretrained
from k3.checkpoint.hf_vision import load_vision
from k3.multimodal import K3ForConditionalGeneration
from k3.vision import VisionConfig, vision_config_from_hf, vision_config_to_hf
from vision_helpers import K3_TINY, K25_TINY, randomize, random_pixels

MEDIA = 255


def saved(tmp_path, variant: dict, name: str = "ckpt"):
    model = K3ForConditionalGeneration(ModelConfig.from_preset("debug"), VisionConfig(**variant), MEDIA)
    randomize(model.vision)
    path = save_pretrained(model.eval(), None, tmp_path / name, progress=False)
    return model, path


def vision_names(path) -> set[str]:
    return {n for n in load_file(path / "model.safetensors") if not n.startswith("language_model.")}


def test_k3_layout_round_trip(tmp_path):
    model, path = saved(tmp_path, K3_TINY)
    blocks = [f"vision_tower.encoder.blocks.{i}.{part}.weight" for i in range(2)
              for part in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1")]
    assert vision_names(path) == {
        "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
        *blocks, "vision_tower.encoder.final_layernorm.weight",
        "mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"}
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["media_placeholder_token_id"] == MEDIA
    assert raw["vision_config"]["qkv_hidden_size"] == 48 and raw["vision_config"]["norm_type"] == "rmsnorm"

    loaded = from_pretrained(path, progress=False)
    assert loaded.vision.config == model.vision.config and loaded.media_token_id == MEDIA
    pixels, grid_thw = random_pixels([[1, 4, 6], [2, 2, 2]])
    ids = torch.tensor([[1, 2] + [MEDIA] * 6 + [3] + [MEDIA] * 1 + [4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids, pixels, grid_thw).logits, model(ids, pixels, grid_thw).logits)
        assert torch.equal(load_vision(path)(pixels, grid_thw), model.vision(pixels, grid_thw))
    text_only = text_from_pretrained(path, progress=False)  # a text-only load still skips the vision part
    assert not any(n.startswith(("vision", "mm_")) for n in text_only.state_dict())


def test_kimi_k25_layout_round_trip_and_dtype(tmp_path):
    model, path = saved(tmp_path, K25_TINY)
    names = vision_names(path)
    assert {"mm_projector.pre_norm.weight", "mm_projector.pre_norm.bias", "vision_tower.patch_embed.proj.bias",
            "vision_tower.encoder.blocks.1.wqkv.bias", "vision_tower.encoder.final_layernorm.bias"} <= names
    assert "mm_projector.post_norm.weight" not in names
    pixels, grid_thw = random_pixels([[1, 6, 4]])
    vision = load_vision(path)
    assert vision.config.pos_emb_interpolation == "bicubic" and vision.config.projector == "patchmerger"
    with torch.no_grad():
        assert torch.equal(vision(pixels, grid_thw), model.vision(pixels, grid_thw))
        half = load_vision(path, dtype="bfloat16")
        assert half.vision_tower.patch_embed.proj.weight.dtype == torch.bfloat16
        err = (half(pixels, grid_thw).float() - model.vision(pixels, grid_thw)).norm() / model.vision(
            pixels, grid_thw).norm()
    assert err < 5e-2


def test_published_config_spellings():
    k3_published = {"model_type": "kimi_k3", "vision_config": {
        "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "vt_num_hidden_layers": 27, "vt_num_attention_heads": 12,
        "qkv_hidden_size": 1536, "patch_size": 14, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2", "text_hidden_size": 7168, "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear", "norm_type": "rmsnorm",
        "mlp_type": "mlp2", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
        "activation_func": "gelu_pytorch_tanh", "video_attn_type": "spatial_temporal"}}
    assert vision_config_from_hf(k3_published) == VisionConfig.from_preset("k3")
    k25_published = {"model_type": "kimi_k25", "text_config": {"hidden_size": 7168}, "vision_config": {
        "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 27,
        "vt_num_attention_heads": 16, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "merge_kernel_size": [2, 2], "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu"}}
    assert vision_config_from_hf(k25_published) == VisionConfig.from_preset("kimi-k2.5")
    for preset in ("k3", "kimi-k2.5", "tiny"):
        config = VisionConfig.from_preset(preset)
        assert vision_config_from_hf({"model_type": "kimi_k3", "vision_config": vision_config_to_hf(config)}) \
            == config
    with pytest.raises(ValueError, match="merge_type='other'"):
        vision_config_from_hf({"vision_config": {"merge_type": "other"}})
    with pytest.raises(ValueError, match="no vision_config"):
        vision_config_from_hf({"model_type": "kimi_linear"})


def test_directories_that_do_not_fit_are_clear_errors(tmp_path):
    _, path = saved(tmp_path, K3_TINY)
    tensors = load_file(path / "model.safetensors")

    del tensors["vision_tower.encoder.blocks.1.wo.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 vision tensor.*blocks.1.wo.weight"):
        load_vision(path)

    raw = json.loads((path / "config.json").read_text())
    raw["vision_config"]["vt_intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mlp.fc0.weight has shape"):
        load_vision(path)

    renamed = {n.replace("vision_tower.encoder.blocks.", "model.vision_tower.layers."): t
               for n, t in load_file(path / "model.safetensors").items()}
    save_file(renamed, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="in-memory kimi_k25 layout"):
        load_vision(path)

    text = tmp_path / "text"
    text_save(K3ForConditionalGeneration(ModelConfig.from_preset("debug"), VisionConfig(**K3_TINY),
                                         MEDIA).language_model, None, text, progress=False)
    with pytest.raises(ValueError, match="no vision_config"):
        load_vision(text)
