"""`k3 convert` between a native k3 checkpoint and the HF layouts, both ways."""

from __future__ import annotations

import json

import torch

from k3.checkpoint import native
from k3.checkpoint.hf import from_pretrained
from k3.data.hf_tokenizer import load_hf_tokenizer
from k3.cli import main
from k3.config import ModelConfig
from k3.model import K3ForCausalLM


def _tokenizer_files(tmp_path) -> dict[str, bytes]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>"])
    return {"tokenizer.json": backend.to_str().encode(),
            "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"}).encode()}


def test_native_to_k3_mxfp4_and_back(tmp_path, capsys):
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    native.save_checkpoint(tmp_path / "run" / "checkpoint.pt",
                           {"model": model.state_dict(), "config": model.config.to_dict(), "step": 7,
                            "tokenizer": _tokenizer_files(tmp_path)})
    assert main(["convert", "--from", str(tmp_path / "run"), "--to", str(tmp_path / "hf"), "--format", "kimi_k3",
                 "--mxfp4"]) == 0
    assert "routed experts in MXFP4" in capsys.readouterr().out
    loaded = from_pretrained(tmp_path / "hf", progress=False)
    tokenizer = load_hf_tokenizer(tmp_path / "hf", required=False)
    assert tokenizer.encode("hello world") == [1, 2] and tokenizer.eos_token_id == 3
    for name, value in model.state_dict().items():
        if ".block_sparse_moe.w" not in name:  # experts went through MXFP4
            assert torch.equal(loaded.state_dict()[name], value), name

    assert main(["convert", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "back"),
                 "--format", "native"]) == 0
    state = native.load_checkpoint(tmp_path / "back")
    again = native.model_from_checkpoint(state, "back")
    for name, value in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    assert set(state["tokenizer"]) >= {"tokenizer.json", "tokenizer_config.json"}


def test_mxfp4_needs_the_k3_layout(tmp_path, capsys):
    assert main(["convert", "--from", str(tmp_path), "--to", str(tmp_path / "x"), "--format", "kimi_linear",
                 "--mxfp4"]) == 1
    assert "--mxfp4 applies to --format kimi_k3 only" in capsys.readouterr().err
