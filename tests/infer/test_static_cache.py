"""The static (preallocated) decode cache used for CUDA-graph decoding, checked on CPU: eager one-token steps
over a StaticCache equal steps over the HybridCache and the full forward; snapshot/restore undoes a step."""

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
from bench.static_decode import StaticCache, decode_step


def model_and_ids():
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    for name, p in model.named_parameters():
        if name.endswith("res.proj.weight"):
            torch.nn.init.normal_(p, std=0.5)
    return model, torch.randint(0, model.config.vocab_size, (2, 20))


@torch.no_grad()
def test_static_decode_equals_hybrid_cache_and_full_forward():
    model, ids = model_and_ids()
    full = model(ids).logits
    hybrid = model.new_cache(2)
    model(ids[:, :8], cache=hybrid)
    static = StaticCache.from_hybrid(model.config, hybrid, capacity=32, dtype=torch.float32)
    for t in range(8, 20):
        expected = model(ids[:, t:t + 1], cache=hybrid).logits[:, -1]
        got = decode_step(model, static, ids[:, t:t + 1])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, full[:, t], rtol=1e-4, atol=1e-4)
    assert int(static.position) == 20
    assert static.nbytes("kda") == StaticCache(model.config, 2, 32, "cpu", torch.float32).nbytes("kda")


@torch.no_grad()
def test_snapshot_restore_undoes_a_step():
    model, ids = model_and_ids()
    hybrid = model.new_cache(2)
    model(ids[:, :8], cache=hybrid)
    static = StaticCache.from_hybrid(model.config, hybrid, capacity=16, dtype=torch.float32)
    saved = static.snapshot()
    first = decode_step(model, static, ids[:, 8:9]).clone()
    static.restore(saved)
    again = decode_step(model, static, ids[:, 8:9])
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_capacity_is_checked():
    model, ids = model_and_ids()
    hybrid = model.new_cache(2)
    with torch.no_grad():
        model(ids[:, :8], cache=hybrid)
    with pytest.raises(ValueError, match="capacity"):
        StaticCache.from_hybrid(model.config, hybrid, capacity=4)
