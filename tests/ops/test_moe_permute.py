"""The MoE token permutations with gather-only backwards (k3.ops.moe.gather_pairs, unpermute_rows) equal plain
indexing: forwards bit for bit, gradients to rounding (the sum over k runs in another order than the scatter-add),
under no_grad, through torch.compile(fullgraph=True), and inside the whole LatentMoE at the tiny preset."""

from __future__ import annotations

import copy

import pytest
import torch

import k3.ops.moe as moe_ops
from k3.config import ModelConfig
from k3.layers.moe import LatentMoE
from k3.ops.moe import gather_pairs, inverse_permutation, unpermute_rows

# (tokens, top_k, experts): one token, one expert per token, and more experts than pairs (some get none).
CASES = [(1, 1, 4), (1, 6, 16), (7, 1, 3), (33, 2, 16), (50, 6, 64)]


def routing(num_tokens: int, top_k: int, num_experts: int, seed: int = 0):
    """Expert order of a random top-k routing: order_N (pairs sorted by expert, stably) and its inverse."""
    gen = torch.Generator().manual_seed(seed)
    ids_TK = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    order_N = ids_TK.reshape(-1).argsort(stable=True)
    return order_N, inverse_permutation(order_N)


def plain_gather(h_TL, order_N, top_k):
    return h_TL[order_N // top_k]


def plain_unpermute(y_NL, order_N):
    return y_NL.index_select(0, inverse_permutation(order_N))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("t,k,e", CASES)
def test_forwards_equal_plain_indexing_exactly(t, k, e, dtype):
    order_N, inverse_N = routing(t, k, e)
    h_TL = (torch.randn(t, 5) * 100).to(dtype)
    y_NL = (torch.randn(t * k, 5) * 100).to(dtype)
    assert torch.equal(gather_pairs(h_TL, order_N, k, inverse_N), plain_gather(h_TL, order_N, k))
    assert torch.equal(unpermute_rows(y_NL, order_N, inverse_N), plain_unpermute(y_NL, order_N))
    # The round trip: pair rows taken into expert order and back are each token's row, K times.
    back_TKL = unpermute_rows(gather_pairs(h_TL, order_N, k, inverse_N), order_N, inverse_N).view(t, k, 5)
    assert torch.equal(back_TKL, h_TL[:, None].expand(t, k, 5))


def gradients(gather, unpermute, h_TL, y_NL, order_N, inverse_N, top_k):
    """Gradients of h and y through a loss that weights every output element differently."""
    h_TL, y_NL = h_TL.detach().requires_grad_(), y_NL.detach().requires_grad_()
    gathered, unpermuted = gather(h_TL, order_N, top_k, inverse_N), unpermute(y_NL, order_N, inverse_N)
    # Weights rounded to bf16 in every dtype, so an fp32 run is the exact gradient of a bf16 run's inputs.
    weight_g = torch.linspace(-1, 1, gathered.numel()).view_as(gathered).bfloat16().to(gathered.dtype)
    weight_u = torch.linspace(2, -3, unpermuted.numel()).view_as(unpermuted).bfloat16().to(unpermuted.dtype)
    loss = (gathered * weight_g).float().sum() + (unpermuted * weight_u).float().sum()
    return torch.autograd.grad(loss, [h_TL, y_NL])


def plain_gradients(h_TL, y_NL, order_N, inverse_N, top_k):
    return gradients(lambda h, o, k, _: plain_gather(h, o, k), lambda y, o, _: plain_unpermute(y, o),
                     h_TL, y_NL, order_N, inverse_N, top_k)


@pytest.mark.parametrize("t,k,e", CASES)
def test_gradients_equal_plain_indexing(t, k, e):
    order_N, inverse_N = routing(t, k, e, seed=t + k)
    h_TL, y_NL = torch.randn(t, 24), torch.randn(t * k, 24)
    got = gradients(gather_pairs, unpermute_rows, h_TL, y_NL, order_N, inverse_N, k)
    want = plain_gradients(h_TL, y_NL, order_N, inverse_N, k)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], want[1])  # the unpermute gradient is a pure gather either way


@pytest.mark.parametrize("t,k,e", CASES)
def test_bf16_gradients_round_once(t, k, e):
    """In bf16 the sum over k accumulates in fp32 and rounds once: within half a bf16 step of the exact
    gradient, and no farther from it than the scatter-add of plain indexing."""
    order_N, inverse_N = routing(t, k, e, seed=t + k)
    h_TL, y_NL = torch.randn(t, 24, dtype=torch.bfloat16), torch.randn(t * k, 24, dtype=torch.bfloat16)
    got = gradients(gather_pairs, unpermute_rows, h_TL, y_NL, order_N, inverse_N, k)
    plain = plain_gradients(h_TL, y_NL, order_N, inverse_N, k)
    exact = plain_gradients(h_TL.float(), y_NL.float(), order_N, inverse_N, k)
    for a, p, x in zip(got, plain, exact):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), x, rtol=2 ** -8, atol=1e-6)
        assert (a.float() - x).abs().max() <= (p.float() - x).abs().max()
    assert torch.equal(got[1], plain[1])


def test_gradcheck_in_float64():
    order_N, inverse_N = routing(5, 3, 6)
    h_TL = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y_NL = torch.randn(15, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: gather_pairs(h, order_N, 3, inverse_N), (h_TL,))
    assert torch.autograd.gradcheck(lambda y: unpermute_rows(y, order_N, inverse_N), (y_NL,))
    assert torch.autograd.gradgradcheck(lambda h: gather_pairs(h, order_N, 3, inverse_N), (h_TL,))


def test_no_grad_gives_plain_tensors():
    order_N, inverse_N = routing(9, 2, 5)
    h_TL = torch.randn(9, 3, requires_grad=True)
    with torch.no_grad():
        out = unpermute_rows(gather_pairs(h_TL, order_N, 2, inverse_N), order_N, inverse_N)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, h_TL.detach().repeat_interleave(2, dim=0))


def permuted_through(h_TL, order_N, inverse_N, top_k: int):
    """Both permutations around an elementwise stand-in for the experts."""
    y_NL = torch.tanh(gather_pairs(h_TL, order_N, top_k, inverse_N))
    return unpermute_rows(y_NL * 1.5, order_N, inverse_N).view(h_TL.shape[0], top_k, -1).sum(1)


def test_compiles_as_one_graph_with_and_without_grad():
    torch._dynamo.reset()
    compiled = torch.compile(permuted_through, fullgraph=True, backend="aot_eager", dynamic=False)
    order_N, inverse_N = routing(11, 3, 8)
    h_TL = torch.randn(11, 6)
    with torch.no_grad():
        assert torch.equal(compiled(h_TL, order_N, inverse_N, 3), permuted_through(h_TL, order_N, inverse_N, 3))
    h_eager, h_compiled = h_TL.clone().requires_grad_(), h_TL.clone().requires_grad_()
    want = permuted_through(h_eager, order_N, inverse_N, 3)
    got = compiled(h_compiled, order_N, inverse_N, 3)
    assert torch.equal(got, want)
    upstream = torch.randn_like(want)
    want.backward(upstream)
    got.backward(upstream)
    torch.testing.assert_close(h_compiled.grad, h_eager.grad, rtol=1e-6, atol=1e-6)


def run_moe(moe: LatentMoE, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in moe.named_parameters()}


@pytest.mark.parametrize("backend", ["loop", "grouped"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_latent_moe_equals_the_plain_indexing_version(monkeypatch, backend, tokens):
    """Forward and every gradient of a training-mode LatentMoE (tiny preset) as before the gather-only
    permutations: the "before" is the same layer with plain indexing patched in (whose backwards scatter-add)."""
    monkeypatch.setenv("K3_MOE_BACKEND", backend)
    torch.manual_seed(0)
    moe = LatentMoE(ModelConfig.from_preset("tiny"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.train()
    reference = copy.deepcopy(moe)
    x = torch.randn(1, tokens, moe.w1.shape[2] if not moe.latent else moe.routed_expert_down_proj.in_features)
    got = run_moe(moe, x)
    with monkeypatch.context() as patch:
        patch.setattr(moe_ops, "gather_pairs", lambda h, order, k, _: plain_gather(h, order, k))
        patch.setattr(moe_ops, "unpermute_rows", lambda y, order, _: plain_unpermute(y, order))
        want = run_moe(reference, x)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        if want[2][name] is None:
            assert got[2][name] is None, name
        else:
            torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(moe.gate.e_score_correction_bias, reference.gate.e_score_correction_bias)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_counting_sort_under_compile_equals_stable_argsort(backend):
    """Compiled, sort_pairs_by_expert counts instead of sorting; it must give argsort(stable=True)'s order exactly
    (ties in pair order), its inverse, and the per-expert counts, also with empty experts."""
    from k3.ops.moe import count_per_expert, inverse_permutation, sort_pairs_by_expert

    torch._dynamo.reset()
    compiled = torch.compile(sort_pairs_by_expert, backend=backend, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for num_pairs, num_experts in [(384, 64), (64, 64), (70, 3), (200, 8)]:
        ids = torch.randint(0, max(1, num_experts - 2), (num_pairs,), generator=g)  # the last experts get none
        order, inverse, counts = compiled(ids, num_experts)
        want = ids.argsort(stable=True)
        assert torch.equal(order, want)
        assert torch.equal(inverse, inverse_permutation(want))
        assert torch.equal(counts, count_per_expert(ids, num_experts)) and counts.dtype == torch.int64

