"""A long prompt prefilled in chunks (each chunk's causal diagonal bottom-right of the cached context, through
SDPA's causal_lower_right instead of a materialised mask) equals the one-shot forward."""

from __future__ import annotations

import pytest
import torch

import k3.layers.mla as mla
from k3 import K3ForCausalLM, ModelConfig


@pytest.mark.parametrize("chunk", [37, 64])
def test_chunked_prefill_equals_one_shot(monkeypatch, chunk):
    monkeypatch.setattr(mla, "ABSORB_MAX_TOKENS", 1)  # every chunk after the first takes the expanded path
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).double().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 150))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        pieces = [model(ids[:, a:a + chunk], cache=cache).logits for a in range(0, ids.shape[1], chunk)]
    chunked = torch.cat(pieces, 1)
    # fp64 throughout, but the KDA chunk kernels carry fp32 pieces: 3.6e-7 measured; a wrong mask gives ~1e-1.
    assert (chunked - full).abs().max().item() < 1e-5


def test_cached_prefills_leave_cudnn_out_and_training_keeps_the_default(monkeypatch):
    """cuDNN's SDPA builds a plan for every new shape, and an engine's prefills bring a new (rows, length) with
    nearly every prompt: forwards with a cache attend with cuDNN switched off; a training forward (no cache, fixed
    rows) leaves the backends as they were. Read from the global switches SDPA dispatches on, so it holds on CPU."""
    seen = []
    real = mla.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(mla.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with torch.no_grad():
        model(ids)
        training = list(seen)
        seen.clear()
        cache = model.new_cache(2)
        model(ids[:, :30], cache=cache)  # from empty: is_causal, where cuDNN would be picked
        model(ids[:, 30:], cache=cache)  # after cached tokens
    assert training and all(training)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # switched back after each call
