"""The fused router kernel (k3.ops.route_triton) against k3.layers.moe.Router's PyTorch forward.

Without a GPU the kernel runs in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the last
test compiles it on CUDA.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")

from k3.config import ModelConfig  # noqa: E402
from k3.layers.moe import COMPILED_LOGITS_MAX_TOKENS, Router  # noqa: E402
from k3.ops import route_triton  # noqa: E402
from k3.ops.moe import count_per_expert  # noqa: E402


def _router(num_experts=12, top_k=3, hidden=40, renormalize=True, scale=2.5, seed=0):
    config = ModelConfig.from_preset("debug", hidden_size=hidden, num_experts=num_experts,
                                     num_experts_per_tok=top_k, router_renormalize=renormalize,
                                     routed_scaling_factor=scale)
    router = Router(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / hidden ** 0.5)
        router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=g) * 0.1)
    return router


def _logits(router, x):
    return x.float() @ router.weight.float().t()


def _tokens(num_tokens, hidden, seed=1):
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed))


@interpreted
@pytest.mark.parametrize("num_experts, top_k, num_tokens, renormalize", [
    (12, 3, 5, True),    # experts fewer than tl.dot's 16 and no power of two
    (64, 6, 37, True),   # `small`'s router, tokens over ten programs with a ragged last block
    (20, 1, 16, False),  # top-1, no renormalisation
])
def test_kernel_equals_the_router(num_experts, top_k, num_tokens, renormalize):
    router = _router(num_experts, top_k, renormalize=renormalize)
    x = _tokens(num_tokens, 40)
    with torch.no_grad():
        want = router._route(x)
        ids, weights, scores = route_triton.route_triton_eager(_logits(router, x), router.e_score_correction_bias,
                                                               top_k, renormalize, router.scale)
    assert ids.dtype == torch.int64 and ids.shape == (num_tokens, top_k)
    torch.testing.assert_close(scores, want.scores_TE, rtol=1e-6, atol=1e-6)
    assert torch.equal(ids, want.topk_ids_TK)  # same experts, in torch.topk's descending order
    torch.testing.assert_close(weights, want.topk_weights_TK, rtol=1e-6, atol=1e-6)


@interpreted
def test_bias_selects_and_scores_weigh():
    """The bias moves an expert into the top-k, but its gate weight is its unbiased score."""
    router = _router(num_experts=16, top_k=2, renormalize=False, scale=1.0)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 10.0
    x = _tokens(4, 40)
    ids, weights, scores = route_triton.route_triton_eager(_logits(router, x), router.e_score_correction_bias, 2,
                                                           False, 1.0)
    assert (ids[:, 0] == 5).all()
    torch.testing.assert_close(weights[:, 0], scores[:, 5])


@interpreted
def test_ties_take_the_lowest_expert():
    router = _router(num_experts=8, top_k=2, renormalize=False, scale=1.0)
    with torch.no_grad():
        router.weight.zero_()  # every score 0.5
        router.e_score_correction_bias.zero_()
    ids, weights, _ = route_triton.route_triton_eager(_logits(router, _tokens(3, 40)),
                                                      router.e_score_correction_bias, 2, False, 1.0)
    assert ids.tolist() == [[0, 1]] * 3
    assert torch.equal(weights, torch.full((3, 2), 0.5))


@interpreted
def test_nan_tokens_stay_nan_and_in_range():
    router = _router()
    x = _tokens(3, 40)
    x[1, 7] = float("nan")
    ids, weights, _ = route_triton.route_triton_eager(_logits(router, x), router.e_score_correction_bias, 3, True,
                                                      router.scale)
    assert ids.min() >= 0 and ids.max() < 12  # the expert kernels must still write every pair's row
    assert torch.isnan(weights[1]).all() and torch.isfinite(weights[[0, 2]]).all()


def test_bad_shapes_say_what_was_expected():
    router = _router()
    with pytest.raises(ValueError, match=r"expected \[12\]"):
        route_triton.route_triton_eager(torch.zeros(2, 12), torch.zeros(11), 3, True, 1.0)
    with pytest.raises(ValueError, match="top_k=13"):
        route_triton.route_triton_eager(_logits(router, _tokens(2, 40)), router.e_score_correction_bias, 13, True, 1.0)


@interpreted
def test_router_takes_the_kernel_in_inference_only(monkeypatch):
    router = _router()
    x = _tokens(6, 40)
    calls = []
    kernel = route_triton.route_triton_eager
    monkeypatch.setattr(route_triton, "route_triton_eager", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setenv("K3_ROUTER_BACKEND", "triton")
    with torch.no_grad():
        want = router._route(x)
        seen = []
        handle = router.register_forward_hook(lambda module, args, output: seen.append(output.topk_ids_TK))
        got = router(x)
        handle.remove()
    assert calls == [1]
    assert torch.equal(got.topk_ids_TK, want.topk_ids_TK) and torch.equal(seen[0], want.topk_ids_TK)
    torch.testing.assert_close(got.topk_weights_TK, want.topk_weights_TK, rtol=1e-6, atol=1e-6)
    # The load is counted from the kernel's ids when asked for.
    assert torch.equal(router.last_load_E, count_per_expert(want.topk_ids_TK, 12).float())
    # Training (QB solves its bias inside the forward) and autograd stay on PyTorch.
    router.train()
    router(x)
    router.eval()
    router(x.requires_grad_())
    assert calls == [1]


def test_auto_stays_on_pytorch_without_cuda(monkeypatch):
    monkeypatch.setenv("K3_ROUTER_BACKEND", "auto")
    router = _router()
    assert not route_triton.route_triton_pays(_tokens(2, 40), router.weight)
    monkeypatch.setenv("K3_ROUTER_BACKEND", "fused")
    with pytest.raises(ValueError, match="use auto, torch or triton"):
        route_triton.route_triton_pays(_tokens(2, 40), router.weight)


@interpreted
def test_custom_op_under_compile(monkeypatch):
    router = _router(num_experts=64, top_k=6)
    x = _tokens(3, 40)
    monkeypatch.setenv("K3_ROUTER_BACKEND", "triton")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda t: router(t).topk_weights_TK, backend="aot_eager", fullgraph=True)(x)
        want = router._route(x).topk_weights_TK
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@interpreted
@pytest.mark.parametrize("num_tokens", [1, COMPILED_LOGITS_MAX_TOKENS, COMPILED_LOGITS_MAX_TOKENS + 1])
def test_compiled_logits_are_a_reduction_for_few_tokens(monkeypatch, num_tokens):
    """Up to COMPILED_LOGITS_MAX_TOKENS a compiled step's router logits are a product and a sum (one Inductor
    reduction), above it a matmul; both route as the eager router does."""
    router = _router(num_experts=64, top_k=6)
    x = _tokens(num_tokens, 40, seed=num_tokens)
    monkeypatch.setenv("K3_ROUTER_BACKEND", "triton")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda t: router(t), backend=record, fullgraph=True)(x)
        want = router._route(x)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    matmuls = sum("matmul" in t or "mm" in t.split(".")[-1] for t in targets)
    assert matmuls == (0 if num_tokens <= COMPILED_LOGITS_MAX_TOKENS else 1), targets
    assert torch.equal(got.topk_ids_TK, want.topk_ids_TK)
    torch.testing.assert_close(got.topk_weights_TK, want.topk_weights_TK, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.scores_TE, want.scores_TE, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_kernel_equals_the_router_cuda_bf16(num_tokens):
    router = _router(num_experts=64, top_k=6, hidden=1024).cuda().bfloat16()
    x = _tokens(num_tokens, 1024).cuda().bfloat16()
    with torch.no_grad():
        want = router._route(x)
        ids, weights, scores = route_triton.route_triton_eager(_logits(router, x), router.e_score_correction_bias,
                                                               6, True, router.scale)
    torch.testing.assert_close(scores, want.scores_TE, rtol=1e-5, atol=1e-5)
    # The logits are the same matmul; the sigmoids may differ by an ulp, which can swap two experts whose biased
    # scores are that close.
    agree = (ids == want.topk_ids_TK).all(1).float().mean().item()
    assert agree > 0.99
    same = (ids == want.topk_ids_TK).all(1)
    torch.testing.assert_close(weights[same], want.topk_weights_TK[same], rtol=1e-5, atol=1e-5)
