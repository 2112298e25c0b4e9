"""fla's KDA options for training (K3_KDA_KEEP_INTERMEDIATES, K3_KDA_CHUNK) reach fla's chunk_kda only in a call
autograd will differentiate, and change nothing on the PyTorch twin. On the CPU fla is the stand-in of
tests/ops/fla_standins.py, wrapped to record the keywords each call receives; the GPU check that fla's kept
intermediates give the recomputed gradients is bench/gpu_check.py's `kda_options`."""

from __future__ import annotations

import sys

import pytest
import torch

from k3 import ModelConfig, kernels
from k3.layers.kda import KimiDeltaAttention
from k3.ops.kda import training_options
from tests.ops import fla_standins


def _layer() -> KimiDeltaAttention:
    torch.manual_seed(5)
    layer = KimiDeltaAttention(ModelConfig.from_preset("debug", hidden_size=64, kda_num_heads=2, kda_head_dim=16), 0)
    layer.reset_gate_parameters()
    return layer.double()


def test_options_follow_the_switches():
    assert training_options() == {}
    with kernels.use(kda_keep="1"):
        assert training_options() == {"disable_recompute": True}
    with kernels.use(kda_chunk="32", kda_keep="0"):
        assert training_options() == {"chunk_size": 32}
    with pytest.raises(ValueError, match="kda_chunk"):
        with kernels.use(kda_chunk="48"):
            training_options()


def test_training_calls_carry_the_options_and_inference_calls_do_not(monkeypatch):
    layer = _layer()
    x = torch.randn(2, 40, 64, dtype=torch.float64, requires_grad=True)
    with fla_standins.installed(monkeypatch):
        fla_kda = sys.modules["fla.ops.kda"]
        seen: list[dict] = []
        inner = fla_kda.chunk_kda

        def recording(*args, **kwargs):
            seen.append({k: kwargs[k] for k in ("disable_recompute", "chunk_size") if k in kwargs})
            return inner(*args, **kwargs)

        monkeypatch.setattr(fla_kda, "chunk_kda", recording)
        from k3.ops.kda import _load_fla
        _load_fla.cache_clear()

        def run():
            y = layer(x)
            return [y, *torch.autograd.grad((y * torch.linspace(-1, 1, 64, dtype=y.dtype)).sum(),
                                            [x, *layer.parameters()])]

        plain = run()
        with kernels.use(kda_keep="1", kda_chunk="32"):
            kept = run()
            with torch.no_grad():
                layer(x)
        assert seen == [{}, {"disable_recompute": True, "chunk_size": 32}, {}]
        for a, b in zip(plain, kept):  # the twin behind the stand-in ignores both options
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla")
def test_kept_intermediates_give_the_recomputed_gradients_cuda():
    """fla's chunk_kda with its forward's intermediates kept (disable_recompute) against recomputing them, through
    the KDA layer at `small`'s head shape in bf16 with packed documents: the same kernels, so within 1e-3."""
    from k3.ops.kda import _use_fla
    torch.manual_seed(6)
    config = ModelConfig.from_preset("small", num_layers=1, full_attn_layers=[])
    layer = KimiDeltaAttention(config, 0).cuda()
    layer.reset_gate_parameters()
    layer = layer.bfloat16()
    x = torch.randn(1, 1024, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_seqlens = torch.tensor([0, 300, 700, 1024], device="cuda")
    position_in_doc = torch.cat([torch.arange(n, device="cuda") for n in (300, 400, 324)])
    assert _use_fla(x)

    def run():
        y = layer(x, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc)
        weights = torch.linspace(-1, 1, y.shape[-1], device="cuda", dtype=y.dtype)
        return [y, *torch.autograd.grad((y.float() * weights).sum(), [x, *layer.parameters()])]

    recomputed = run()
    with kernels.use(kda_keep="1"):
        kept = run()
    for a, b in zip(kept, recomputed):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        assert err < 1e-3, err
