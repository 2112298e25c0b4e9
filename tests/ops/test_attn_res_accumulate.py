"""Finished AttnRes sources whose gradients the Triton backward sums in place (k3.ops.attn_res_triton.
FinishedSources): every mix that reads such a source adds its share into one tensor, and autograd sees one
consumer of the source. Held to the eager twin and to the same kernels with autograd's additions, in fp32, and
in a whole model against K3_ATTN_RES_ACCUMULATE=0.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import functools
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from k3.ops.attn_res import attn_res_mix_eager, set_attn_res_backend  # noqa: E402
from k3.ops.attn_res_triton import Blocks, FinishedSources, attn_res_mix_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
EPS = 1e-5
SMALL = Blocks(block_n=4, block_d=32, num_warps=4, programs=2)


def _stream(leaves, queries, mix, register: bool):
    """A block-AttnRes-like chain: three finished sources (two leaves and a block built from them), each read by
    every later mix, and a running partial; returns the sum of every mix against fixed upstream weights."""
    g = torch.Generator().manual_seed(1)
    emb, first = leaves
    finished = FinishedSources() if register else None
    blocks = [emb * 1.0]  # a non-leaf, as the embedding's output is
    if finished is not None:
        finished.add(blocks[0])
    partial = first * 0.5
    total = 0
    for step, (norm_w, query) in enumerate(queries):
        out = mix(blocks + [partial], norm_w, query, finished)
        total = total + (out * torch.randn(out.shape, generator=g).to(out)).sum()
        partial = partial + torch.tanh(out)
        if step in (1, 3):  # close a block: the partial becomes a finished source
            blocks.append(partial)
            if finished is not None:
                finished.add(partial)
            partial = torch.sigmoid(out)
    out = mix(blocks, *queries[0], finished)  # the output mix: finished sources only
    return total + (out * torch.randn(out.shape, generator=g).to(out)).sum()


def _triton(sources, norm_w, query, finished):
    return attn_res_mix_triton(sources, norm_w, query, EPS, blocks=SMALL, backward_blocks=SMALL, finished=finished)


def _eager(sources, norm_w, query, finished):
    return attn_res_mix_eager(sources, norm_w, query, EPS)


def _inputs(dim=40, tokens=9, mixes=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, tokens, dim, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(2)]
    queries = [((torch.rand(dim, generator=g) + 0.5).to(DEVICE).requires_grad_(),
                torch.randn(dim, generator=g).to(DEVICE).requires_grad_()) for _ in range(mixes)]
    return leaves, queries


@functools.lru_cache(maxsize=None)  # seeded inputs: the same gradients every call (the bf16 test reuses fp32's)
def _grads(mix, register, dtype=torch.float32):
    leaves, queries = _inputs(dtype=dtype)
    params = [*leaves, *(t for pair in queries for t in pair)]
    return torch.autograd.grad(_stream(leaves, queries, mix, register), params)


def test_in_place_sums_match_autograds_additions_and_the_eager_twin():
    summed = _grads(_triton, register=True)
    added = _grads(_triton, register=False)
    eager = _grads(_eager, register=False)
    for got, plain, want in zip(summed, added, eager):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got, plain, rtol=2e-5, atol=2e-5)


def test_in_place_sums_in_bf16_round_once():
    """bf16 sources: the in-place sum rounds once per mix where autograd rounds each share and then each
    addition, so against the fp32 run it is at least as close as the additions are."""
    exact = _grads(_triton, register=True)
    summed = _grads(_triton, register=True, dtype=torch.bfloat16)
    added = _grads(_triton, register=False, dtype=torch.bfloat16)
    for got, plain, want in zip(summed[:2], added[:2], exact[:2]):
        err_summed = float((got.double() - want.double()).norm() / want.double().norm())
        err_added = float((plain.double() - want.double()).norm() / want.double().norm())
        assert err_summed < 1e-2 and err_summed <= err_added * 1.05, (err_summed, err_added)


def test_a_registered_source_has_one_consumer_and_backward_can_run_twice():
    leaves, queries = _inputs()
    loss = _stream(leaves, queries, _triton, register=True)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The leaf `emb` feeds one op (emb * 1.0), whose output is registered: its one consumer is the collector.
    leaves, queries = _inputs()
    finished = FinishedSources()
    block = leaves[0] * 1.0
    finished.add(block)
    for norm_w, query in queries[:3]:
        _triton([block, leaves[1] * 1.0], norm_w, query, finished)
    consumers = [node for node in _nodes(finished.tokens[0].grad_fn) if node is not None]
    assert [n.name() for n in consumers] == ["MulBackward0"]
    assert finished.tokens[0].grad_fn.name() == "_CollectBackward"


def _nodes(grad_fn):
    return [f for f, _ in grad_fn.next_functions]


def test_a_source_without_gradient_and_a_source_read_through_a_copy_go_to_autograd():
    leaves, queries = _inputs()
    frozen = leaves[0].detach() * 1.0
    finished = FinishedSources()
    finished.add(frozen)
    assert finished.tokens == [None] and finished.leading([frozen]) == 0
    strided = torch.randn(1, 40, 9).to(DEVICE).transpose(1, 2).requires_grad_()  # [1, 9, 40], not contiguous
    blocks = [strided * 1.0]  # keeps the leaf's strides: a non-contiguous non-leaf, which _rows copies
    assert not blocks[0].is_contiguous()
    finished = FinishedSources()
    finished.add(blocks[0])
    norm_w, query = queries[0]
    out = _triton([blocks[0], leaves[1]], norm_w, query, finished)
    want = _eager([blocks[0], leaves[1]], norm_w, query, None)
    g = torch.randn(out.shape).to(out)
    got_grads = torch.autograd.grad(out, [strided, leaves[1]], g, retain_graph=True)
    want_grads = torch.autograd.grad(want, [strided, leaves[1]], g)
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_whole_model_gradients_with_and_without_in_place_sums(monkeypatch):
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM
    from k3.ops.fused_backend import set_fused_backend
    from k3.ops.kda import set_kda_backend

    config = ModelConfig.from_preset("debug", attn_res_block_size=1)  # 4 layers, KDA and MLA
    torch.manual_seed(0)
    model = K3ForCausalLM(config).to(DEVICE)
    for module in model.modules():  # nonzero pseudo-queries, so the mixes are not uniform means
        if hasattr(module, "proj") and hasattr(module, "norm"):
            torch.nn.init.normal_(module.proj.weight, std=0.5)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    import k3.ops.attn_res_triton as kernels_module

    masks = {"1": [], "0": []}
    flag_now = []
    original = kernels_module.mix_backward

    def recording(*args):
        masks[flag_now[-1]].append(args[-1] if len(args) > 8 else 0)
        return original(*args)

    monkeypatch.setattr(kernels_module, "mix_backward", recording)
    grads = {}
    set_attn_res_backend("triton")
    set_kda_backend("torch")
    set_fused_backend("torch")
    try:
        for flag in ("1", "0"):
            monkeypatch.setenv("K3_ATTN_RES_ACCUMULATE", flag)
            flag_now.append(flag)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            model(ids, labels=ids, return_logits=False).loss.backward()
            grads[flag] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        set_attn_res_backend(None)
        set_kda_backend(None)
        set_fused_backend(None)
    # 4 layers in blocks of one: 8 mixes and the output mix, the first of them over one source (no kernel); with
    # the sums on, every mix but the output one (the first to run backward, which writes) adds into the sources.
    assert len(masks["1"]) == len(masks["0"]) == 8
    assert masks["1"][0] == 0 and all(masks["1"][1:]) and not any(masks["0"])
    assert grads["1"].keys() == grads["0"].keys() and "model.embed_tokens.weight" in grads["1"]
    for name, want in grads["0"].items():
        torch.testing.assert_close(grads["1"][name], want, rtol=1e-4, atol=1e-6, msg=name)
