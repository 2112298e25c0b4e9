"""The AttnRes mix op equals the formula it implements; the compiled twin equals eager (slow: compiles)."""

import pytest
import torch

from k3.ops.attn_res import attn_res_backend, attn_res_mix, attn_res_mix_eager, set_attn_res_backend


def reference(sources, norm_w, query, eps):
    q = norm_w.double() * query.double()
    values = [v.double() for v in sources]
    scores = torch.stack([(v @ q) / v.pow(2).mean(-1).add(eps).sqrt() for v in values])
    return (scores.softmax(0).unsqueeze(-1) * torch.stack(values)).sum(0)


def test_eager_mix_matches_formula():
    torch.manual_seed(0)
    sources = [torch.randn(2, 5, 16) * (i + 1) for i in range(4)]
    norm_w, query = torch.rand(16) + 0.5, torch.randn(16)
    out = attn_res_mix_eager(sources, norm_w, query, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(sources, norm_w, query, 1e-5), rtol=1e-5, atol=1e-5)


def test_backend_switch_and_cpu_default():
    x = torch.zeros(1)
    assert attn_res_backend(x) == "torch"
    set_attn_res_backend("compiled")
    try:
        assert attn_res_backend(x) == "compiled"
    finally:
        set_attn_res_backend(None)
    with pytest.raises(ValueError, match="auto"):
        set_attn_res_backend("fused")


@pytest.mark.slow
def test_compiled_mix_equals_eager():
    torch.manual_seed(1)
    sources = [torch.randn(2, 7, 32, requires_grad=True) for _ in range(3)]
    norm_w, query = torch.rand(32, requires_grad=True), torch.randn(32, requires_grad=True)
    outs = []
    for backend in ("eager", "compiled"):
        set_attn_res_backend(backend)
        try:
            y = attn_res_mix(sources, norm_w, query, 1e-5)
            outs.append([y, *torch.autograd.grad(y.sum() + (y * y).sum(), [*sources, norm_w, query])])
        finally:
            set_attn_res_backend(None)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_mix_serves_every_source_count_and_length_with_one_graph():
    """Decode changes T and every layer changes the source count; one graph must cover them all, including
    batch 1 and length 1, which dynamo would otherwise specialise (a graph each, tens of seconds on CUDA)."""
    torch.manual_seed(2)
    norm_w, query = torch.rand(32), torch.randn(32)
    set_attn_res_backend("compiled")
    try:
        torch._dynamo.reset()
        first = [torch.randn(3, 4, 32) for _ in range(2)]
        torch.testing.assert_close(attn_res_mix(first, norm_w, query, 1e-5),
                                   attn_res_mix_eager(first, norm_w, query, 1e-5), rtol=1e-5, atol=1e-5)
        with torch.compiler.set_stance("fail_on_recompile"):
            for count in (2, 3, 7, 11):
                for batch, length in ((1, 1), (2, 1), (1, 5), (2, 17), (1, 64)):
                    sources = [torch.randn(batch, length, 32) for _ in range(count)]
                    out = attn_res_mix(sources, norm_w, query, 1e-5)
                    assert out.shape == (batch, length, 32)
                    torch.testing.assert_close(out, attn_res_mix_eager(sources, norm_w, query, 1e-5),
                                               rtol=1e-5, atol=1e-5)
    finally:
        set_attn_res_backend(None)
