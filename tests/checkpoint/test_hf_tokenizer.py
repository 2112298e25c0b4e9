"""Tokenizers read from checkpoint directories: Kimi's tiktoken form and tokenizer.json, with chat templates."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from k3.checkpoint.hf import from_pretrained, save_pretrained
from k3.data.hf_tokenizer import load_hf_tokenizer
from k3.config import ModelConfig
from k3.model import K3ForCausalLM

TEMPLATE = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b"12", b"123",
          "你好".encode(), b"\xe4\xbd", b"\xe4\xbd\xa0", b"\xe5\xa5", b"\xe5\xa5\xbd"]


def _write_tiktoken_dir(directory, with_template: bool = True):
    """A Kimi-style tokenizer: byte-level ranks + a few merges, specials named in added_tokens_decoder."""
    ranks = {bytes([i]): i for i in range(256)}
    for token in MERGES:
        ranks.setdefault(token, len(ranks))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    base = len(ranks)
    names = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"]
    config = {"bos_token": "[BOS]", "eos_token": {"content": "[EOS]"},
              "added_tokens_decoder": {str(base + i): {"content": n, "special": True} for i, n in enumerate(names)}}
    if with_template:
        config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return ranks


def test_kimi_tiktoken_directory(tmp_path):
    ranks = _write_tiktoken_dir(tmp_path / "tok")
    tokenizer = load_hf_tokenizer(tmp_path / "tok")
    base = len(ranks)
    assert tokenizer.vocab_size == base + 256  # Kimi reserves 256 special ids after the BPE ranks
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (base, base + 1)
    assert tokenizer.token_to_id(f"<|reserved_token_{base + 100}|>") == base + 100
    text = "hello world 你好 123456"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Kimi's split: Han characters form one piece, digits go in groups of three ("123", "456").
    assert ids[:2] == [ranks[b"hello"], ranks[b" world"]]
    assert ranks["你好".encode()] in ids and ranks[b"123"] in ids
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|im_user|>hello<|im_end|><|im_assistant|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True) == \
        [base + 3, ranks[b"hello"], base + 2, base + 4]

    tokenizer.save(tmp_path / "saved")
    again = load_hf_tokenizer(tmp_path / "saved")
    assert again.encode(text + "<|im_end|>") == tokenizer.encode(text + "<|im_end|>")
    assert again.chat_template == TEMPLATE and again.vocab_size == tokenizer.vocab_size


def test_tokenizer_json_directory_and_template_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    directory = tmp_path / "tok"
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")
    tokenizer = load_hf_tokenizer(directory)
    assert tokenizer.encode("hello world!") == [1, 2, 3]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (4, 5, 6)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True) == [1, 5]


def test_from_pretrained_returns_the_directory_tokenizer(tmp_path):
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=600)).eval()
    _write_tiktoken_dir(tmp_path / "tok")
    tokenizer = load_hf_tokenizer(tmp_path / "tok")
    save_pretrained(model, tokenizer, tmp_path / "ckpt", format="kimi_k3", progress=False)
    loaded_model = from_pretrained(tmp_path / "ckpt", progress=False)
    loaded_tokenizer = load_hf_tokenizer(tmp_path / "ckpt", required=False)
    ids = loaded_tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=True)
    with torch.no_grad():
        logits = loaded_model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 600) and torch.isfinite(logits).all()


def test_missing_template_and_missing_tokenizer_are_explained(tmp_path):
    _write_tiktoken_dir(tmp_path / "tok", with_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        load_hf_tokenizer(tmp_path / "tok").apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json and no tiktoken.model"):
        load_hf_tokenizer(tmp_path / "none")
    assert load_hf_tokenizer(tmp_path / "none", required=False) is None
