"""Broken checkpoint directories fail with errors that say what is wrong; `k3 convert` reports them too."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.checkpoint.hf import from_pretrained, save_pretrained
from k3.cli import main
from k3.config import ModelConfig
from k3.model import K3ForCausalLM


@pytest.fixture
def sharded(tmp_path):
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    return save_pretrained(model, None, tmp_path / "ckpt", format="kimi_k3", max_shard_size="100KB",
                           progress=False)


@pytest.fixture
def single(tmp_path):
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    return save_pretrained(model, None, tmp_path / "single", format="kimi_k3", progress=False)


def test_missing_shard(sharded):
    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    os.remove(sharded / shards[1])
    with pytest.raises(FileNotFoundError, match=f"missing.*{shards[1]}"):
        from_pretrained(sharded, progress=False)


def test_truncated_safetensors(sharded):
    shard = sharded / sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="not a readable safetensors file.*truncated"):
        from_pretrained(sharded, progress=False)


def test_wrong_shape(single):
    state = load_file(str(single / "model.safetensors"))
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    rows, cols = state[name].shape
    state[name] = torch.zeros(rows + 1, cols)
    save_file(state, str(single / "model.safetensors"))
    message = rf"q_proj.weight has shape \({rows + 1}, {cols}\) but config.json implies \({rows}, {cols}\)"
    with pytest.raises(ValueError, match=message):
        from_pretrained(single, progress=False)


def test_missing_tensor_names_the_published_name(single):
    state = load_file(str(single / "model.safetensors"))
    del state["language_model.model.layers.1.mlp_res_norm.weight"]
    save_file(state, str(single / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*language_model\.model\.layers\.1\.mlp_res_norm\.weight"):
        from_pretrained(single, progress=False)


def test_unknown_model_type(single):
    config = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps(config["text_config"] | {"model_type": "llama"}))
    with pytest.raises(ValueError, match="unknown model_type 'llama'.*kimi_linear"):
        from_pretrained(single, progress=False)


def test_no_weights_and_no_config(tmp_path, single):
    os.remove(single / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        from_pretrained(single, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "empty", progress=False)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        from_pretrained(tmp_path / "nowhere", progress=False)


def test_convert_command_reports_errors_and_converts(tmp_path, single, capsys):
    assert main(["convert", "--from", str(tmp_path / "nowhere"), "--to", str(tmp_path / "x")]) == 1
    assert "k3: error: --from" in capsys.readouterr().err
    assert main(["convert", "--from", str(single), "--to", str(tmp_path / "mx"), "--format", "kimi_k3",
                 "--mxfp4", "--max-shard-size", "200KB"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]["format"] == \
        "mxfp4-pack-quantized"
    # A K3-only model cannot be written in the Kimi-Linear layout.
    assert main(["convert", "--from", str(single), "--to", str(tmp_path / "kl"), "--format", "kimi_linear"]) == 1
    assert "kimi_k3" in capsys.readouterr().err
    assert not (tmp_path / "kl").exists()
