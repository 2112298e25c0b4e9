"""k3: an open PyTorch implementation of the Kimi K3 architecture."""

from k3.config import ModelConfig

__all__ = ["ModelConfig", "K3ForCausalLM", "from_pretrained", "save_pretrained", "load_tokenizer"]


def __getattr__(name):
    # The model pulls in every layer; keep `import k3` light for the CLI and the sandbox.
    if name == "K3ForCausalLM":
        from k3.model import K3ForCausalLM

        return K3ForCausalLM
    if name in ("from_pretrained", "save_pretrained", "load_tokenizer"):
        from k3.checkpoint import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
