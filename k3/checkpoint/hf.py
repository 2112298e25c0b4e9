"""Hugging Face-format checkpoints: the public entry points.

    model = from_pretrained("/path/to/Kimi-Linear-48B-A3B-Instruct", dtype="bfloat16")
    tokenizer = load_tokenizer("/path/to/Kimi-Linear-48B-A3B-Instruct")
    save_pretrained(model, tokenizer, "/path/out", format="kimi_k3", mxfp4_experts=True, max_shard_size="5GB")

Formats: 'kimi_linear' (transformers' / Moonshot's Kimi-Linear layout) and 'kimi_k3' (the published K3 layout,
routed experts optionally in MXFP4). Name maps: hf_names.py; reading: hf_load.py; writing: hf_save.py;
tokenizers: k3/data/hf_tokenizer.py; MXFP4: mxfp4.py. See docs/checkpoints.md.
"""

from k3.checkpoint.hf_load import from_pretrained, load_hf_weights, read_hf_config
from k3.checkpoint.hf_save import checkpoint_tensors, save_pretrained
from k3.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer


def load_tokenizer(path) -> HFTokenizer:
    """The tokenizer of an HF-format directory (tokenizer.json or tiktoken.model); raises if it has none."""
    return load_hf_tokenizer(path, required=True)


__all__ = ["from_pretrained", "save_pretrained", "load_tokenizer", "load_hf_tokenizer", "HFTokenizer", "read_hf_config",
           "load_hf_weights", "checkpoint_tensors"]
