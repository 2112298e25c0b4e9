"""Causal attention over packed documents (k3.ops.packed_attention): the masked twin equals one causal SDPA call
per document (outputs and gradients); the varlen path's plumbing (cu_seqlens padded with zero-length documents,
flattened rows) equals the twin with a CPU stand-in for torch's varlen_attn; on CUDA the real flash varlen
kernel equals the twin in bf16, and the model's static-documents step takes it."""

import pytest
import torch
import torch.nn.functional as F

from k3 import kernels
from k3.model import pad_cu_seqlens
from k3.ops import packed_attention as pa

ROWS, LENGTH, HEADS, DIM = 2, 48, 3, 16
# documents inside each row (rows start documents too): 20 + 28 | 5 + 1 + 30 + 12
CU = torch.tensor([0, 20, 48, 53, 54, 84, 96])


def positions(cu: torch.Tensor, total: int) -> torch.Tensor:
    index = torch.arange(total)
    return index - cu[torch.searchsorted(cu[1:], index, right=True)]


def per_document(q, k, v, cu, scale):
    """The oracle: one causal SDPA call per document, [1, total, H, d] in and out."""
    pieces = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            pieces.append(F.scaled_dot_product_attention(q[0, a:b].transpose(0, 1), k[0, a:b].transpose(0, 1),
                                                         v[0, a:b].transpose(0, 1), is_causal=True, scale=scale)
                          .transpose(0, 1))
    return torch.cat(pieces).unsqueeze(0)


def inputs(dtype=torch.float32, device="cpu", dv=DIM):
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, ROWS * LENGTH, HEADS, DIM)] * 2 + [(1, ROWS * LENGTH, HEADS, dv)]
    return [torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_() for shape in shapes]


def with_grads(fn, tensors):
    out = fn(*tensors)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return [out, *torch.autograd.grad(out, tensors, grad)]


def test_the_masked_twin_equals_attention_document_by_document():
    tensors = inputs(dv=DIM + 8)  # v wider than q and k, as in MLA (the twin takes any v width)
    want = with_grads(lambda q, k, v: per_document(q, k, v, CU, 0.3), tensors)
    got = with_grads(lambda q, k, v: pa.packed_attention_masked(q, k, v, positions(CU, ROWS * LENGTH), LENGTH, 0.3),
                     tensors)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def varlen_standin(keyword):
    """torch's varlen_attn contract on the CPU (documents of cu_seqlens, zero-length ones allowed, max_q bounding
    every length), with the causal keyword of 2.10+ (window_size) or of 2.9 (is_causal)."""
    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, **causal):
        assert causal == ({"window_size": (-1, 0)} if keyword == "window_size" else {"is_causal": True})
        assert query.shape[-1] == key.shape[-1] == value.shape[-1] and query.shape[-1] % 8 == 0
        assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
        bounds = cu_seq_q.tolist()
        assert max(b - a for a, b in zip(bounds[:-1], bounds[1:])) <= max_q
        seen.append((len(bounds) - 1, max_q))
        return per_document(query[None], key[None], value[None], cu_seq_q, scale)[0]

    if keyword == "window_size":
        def standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
            return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                               window_size=window_size)
    else:
        def standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None,
                    scale=None):
            return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, is_causal=is_causal)
    return standin, seen


@pytest.mark.parametrize("keyword, dv", [("window_size", DIM), ("is_causal", DIM), ("window_size", DIM - 4),
                                         ("window_size", DIM + 10)])
def test_the_varlen_path_over_padded_documents_equals_the_twin(monkeypatch, keyword, dv):
    standin, seen = varlen_standin(keyword)
    monkeypatch.setattr(pa, "_varlen_attn", lambda: standin)
    pa._causal_keywords.cache_clear()
    try:
        padded = pad_cu_seqlens(CU, 10)  # four zero-length documents at the end: the static form
        tensors = inputs(dv=dv)  # v narrower or wider than q: padded to one width, the output cut back
        want = with_grads(lambda q, k, v: pa.packed_attention_masked(q, k, v, positions(CU, ROWS * LENGTH), LENGTH,
                                                                     0.3), tensors)
        got = with_grads(lambda q, k, v: pa.packed_attention_varlen(q, k, v, padded, LENGTH, 0.3), tensors)
    finally:
        pa._causal_keywords.cache_clear()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert seen == [(10, LENGTH)]


def test_auto_keeps_the_twin_on_cpu_and_forcing_varlen_there_says_why():
    q, k, v = inputs()
    padded = pad_cu_seqlens(CU, 10)
    with kernels.use(packed_attention="auto"):
        assert pa.packed_attention_backend(q, k, v, padded) == "torch"
    with kernels.use(packed_attention="varlen"):
        assert pa.packed_attention_backend(q, k, v, None) == "torch"  # no documents given: nothing to split by
        with pytest.raises(RuntimeError, match="'varlen' forced but it cannot run here.*K3_PACKED_ATTENTION=auto"):
            pa.packed_causal_attention(q, k, v, positions(CU, ROWS * LENGTH), LENGTH, 0.3, padded)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_flash_varlen_equals_the_twin_in_bf16_cuda():
    if pa._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    tensors = inputs(torch.bfloat16, "cuda")
    padded = pad_cu_seqlens(CU, 10).cuda()
    pos = positions(CU, ROWS * LENGTH).cuda()
    assert pa.varlen_suits(*tensors)
    want = with_grads(lambda q, k, v: pa.packed_attention_masked(q, k, v, pos, LENGTH, 0.25), tensors)
    got = with_grads(lambda q, k, v: pa.packed_attention_varlen(q, k, v, padded, LENGTH, 0.25), tensors)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@cuda
def test_the_static_documents_step_with_varlen_equals_the_twin_cuda():
    from k3 import K3ForCausalLM, ModelConfig

    if pa._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    config = ModelConfig.from_preset("debug")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).cuda().eval()
    ids = torch.randint(1, config.vocab_size, (1, ROWS * LENGTH), device="cuda")
    padded = pad_cu_seqlens(CU, 10).cuda()
    losses = {}
    for choice in ("torch", "varlen"):
        with kernels.use(packed_attention=choice), torch.autocast("cuda", torch.bfloat16):
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids, return_logits=False, cu_seqlens=padded, max_documents=10,
                         row_length=LENGTH).loss
            loss.backward()
        losses[choice] = (float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                        if p.grad is not None})
    assert abs(losses["varlen"][0] - losses["torch"][0]) < 2e-2
    for name, grad in losses["torch"][1].items():
        torch.testing.assert_close(losses["varlen"][1][name], grad, rtol=5e-2, atol=5e-3, msg=name)
