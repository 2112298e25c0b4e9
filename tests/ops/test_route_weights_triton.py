"""k3.ops.route_weights: the router's gate weights (sigmoid of the chosen logits, renormalisation, scale) as one
Triton kernel forward and one backward, against an fp64 oracle and the PyTorch twin on the weights and on
d_logits; the Router's training forward with the switch at `triton` and at `torch`; and, counted by
bench/launch_census.py's recorder, that the kernel path launches fewer kernels.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from k3 import kernels  # noqa: E402
from k3.config import ModelConfig  # noqa: E402
from k3.layers.moe import Router  # noqa: E402
from k3.ops.route_weights import FORWARD_BLOCK_T, _block_t, route_weights_torch, route_weights_triton  # noqa: E402
from k3.rl.routing import RoutingReplay  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the census records the interpreter's launches")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _weights_and_grad(fn, logits, ids, upstream, renormalize, scale):
    """fn's weights and d_logits for upstream gradient `upstream` on the weights."""
    logits = logits.detach().requires_grad_()
    weights = fn(logits, ids, renormalize, scale)
    return weights, torch.autograd.grad(weights, logits, upstream.to(weights.dtype))[0]


def _twin(logits, ids, renormalize, scale):
    return route_weights_torch(torch.sigmoid(logits), ids, renormalize, scale)


def _case(tokens, experts, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(tokens, experts, generator=g)).to(DEVICE, dtype)
    ids = logits.float().topk(k, dim=-1).indices
    upstream = torch.randn(tokens, k, generator=g).to(DEVICE)
    return logits, ids, upstream


# Against the fp64 oracle: d_logits' s (1 - s) loses bits for saturated sigmoids (logits of +-6 here) in the twin
# just as in the kernel (4.8e-6 for both at 896 experts); against the twin, the kernel differs by the order of its
# fp32 sums over k.
FP32_TOL = dict(weights=2e-6, d_logits=1e-5, twin=1e-6)
# In bf16 the twin rounds after every op (2.2e-2 from the oracle on d_logits) where the kernel computes in fp32
# and rounds once (2.5e-3): the kernel is held to the oracle and to doing no worse than the twin.
BF16_TOL = dict(weights=8e-3, d_logits=8e-3, twin=None)


def _check_all(logits, ids, upstream, renormalize, scale, tol=FP32_TOL):
    """Kernel, twin (in the logits' dtype) and the fp64 oracle agree on the weights and d_logits; d_logits is 0 off
    the chosen experts."""
    oracle = _weights_and_grad(_twin, logits.double(), ids, upstream.double(), renormalize, scale)
    with kernels.use(route_weights="triton"):
        fused = _weights_and_grad(route_weights_triton, logits, ids, upstream, renormalize, scale)
    twin = _weights_and_grad(_twin, logits, ids, upstream, renormalize, scale)
    for name, got, want, ref in zip(("weights", "d_logits"), fused, twin, oracle):
        assert got.dtype == want.dtype == logits.dtype and got.shape == want.shape, name
        assert _rel(got, ref) < tol[name], (name, _rel(got, ref))
        if tol["twin"] is None:
            assert _rel(got, ref) <= _rel(want, ref), (name, _rel(got, ref), _rel(want, ref))
        else:
            assert _rel(got, want) < tol["twin"], (name, _rel(got, want))
    chosen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, ids, True)
    assert torch.equal(fused[1][~chosen], torch.zeros_like(fused[1][~chosen]))
    return fused


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.446])
@pytest.mark.parametrize("tokens, experts, k", [
    (77, 64, 6),    # `small`'s router: 32 tokens a backward program, a ragged third block
    (150, 12, 3),   # experts no power of two; 128 tokens a program both ways, a ragged second block
    (5, 896, 16),   # K3's router: 2 tokens a backward program
])
def test_kernels_match_the_fp64_oracle_and_the_twin(renormalize, scale, tokens, experts, k):
    assert tokens % _block_t(experts) and tokens % FORWARD_BLOCK_T  # the last program's block is ragged
    _check_all(*_case(tokens, experts, k, seed=tokens + experts), renormalize, scale)


def test_tied_logits_with_duplicate_free_ids():
    logits, _, upstream = _case(70, 16, 4, seed=3)
    logits = (logits * 2).round() / 2  # many equal logits in a row: ties at the selection's cut
    ids = logits.topk(4, dim=-1).indices
    assert all(len(set(row.tolist())) == 4 for row in ids)
    assert any(len(set(row.tolist())) < 16 for row in logits)
    _check_all(logits, ids, upstream, True, 2.5)


def test_an_expert_chosen_twice_gets_both_pairs_gradients_like_the_gather():
    logits, ids, upstream = _case(40, 8, 3, seed=4)
    ids[:, 2] = ids[:, 0]  # not what a top-k gives; the gather's backward sums the two pairs
    _check_all(logits, ids, upstream, True, 1.5)


def test_strided_logits_ids_and_upstream():
    wide, ids_wide, _ = _case(50, 20, 5, seed=5)
    logits = wide[:, 3:17]  # a column slice: row stride 20
    ids = logits.topk(4, dim=-1).indices[:, :3]  # the published QB's k of its k + 1 picks: row stride 4
    assert not logits.is_contiguous() and not ids.is_contiguous()
    upstream = torch.randn(3, 50, device=DEVICE).t()  # column-major
    _check_all(logits, ids, upstream, True, 2.0)
    _check_all(logits.t().contiguous().t(), ids.int(), upstream, False, 2.0)  # column-major logits, int32 ids


def test_a_broadcast_upstream_gradient():
    logits, ids, _ = _case(33, 24, 4, seed=6)
    with kernels.use(route_weights="triton"):
        leaf = logits.clone().requires_grad_()
        route_weights_triton(leaf, ids, False, 3.0).sum().backward()  # a [T, K] gradient with strides (0, 0)
    twin = logits.clone().requires_grad_()
    _twin(twin, ids, False, 3.0).sum().backward()  # (renormalised weights sum to 3.0 whatever the logits)
    assert _rel(leaf.grad, twin.grad) < FP32_TOL["twin"]


def test_bf16_logits_give_bf16_weights_and_gradients():
    logits, ids, upstream = _case(45, 64, 6, seed=7, dtype=torch.bfloat16)
    fused = _check_all(logits, ids, upstream, True, 2.446, tol=BF16_TOL)
    assert fused[0].dtype == fused[1].dtype == torch.bfloat16


def test_no_tokens():
    logits = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    weights = route_weights_triton(logits, ids, True, 1.0)
    assert weights.shape == (0, 2)
    (grad,) = torch.autograd.grad(weights.sum(), logits)
    assert grad.shape == (0, 8)


def test_an_id_outside_the_experts_reads_nothing_and_gets_no_gradient():
    logits, ids, upstream = _case(20, 8, 2, seed=8)
    ids[3, 1], ids[7, 0] = 8, -1  # past the last expert and before the first
    weights, grad = _weights_and_grad(route_weights_triton, logits, ids, upstream, False, 1.0)
    assert weights[3, 1] == 0 and weights[7, 0] == 0
    assert torch.equal(weights[3, 0], torch.sigmoid(logits[3, ids[3, 0]]))
    assert torch.isfinite(grad).all() and grad[3, ids[3, 0]] != 0


def test_ids_of_another_token_count_are_refused():
    with pytest.raises(ValueError, match=r"T = 5 \(the logits' rows\)"):
        route_weights_triton(torch.zeros(5, 8, device=DEVICE), torch.zeros(4, 2, dtype=torch.int64, device=DEVICE),
                             True, 1.0)


def _router(renormalize=True, scale=2.5, aux_loss_coef=0.0, seed=0):
    config = ModelConfig.from_preset("debug", hidden_size=40, num_experts=12, num_experts_per_tok=3,
                                     router_renormalize=renormalize, routed_scaling_factor=scale)
    router = Router(config).to(DEVICE).train()
    router.aux_loss_coef = aux_loss_coef
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / 40 ** 0.5)
    return router


def _router_step(router, x, upstream):
    """A training forward of the router and the gradient of its weight for `upstream` on the gate weights."""
    routing = router(x)
    loss = (routing.topk_weights_TK * upstream).sum() + (router.aux_loss if router.aux_loss is not None else 0)
    (grad,) = torch.autograd.grad(loss, router.weight)
    return routing, grad


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_routes_and_trains_the_same_with_the_kernels(renormalize):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(70, 40, generator=g).to(DEVICE)
    upstream = torch.randn(70, 3, generator=g).to(DEVICE)
    runs = {}
    for choice in ("torch", "triton"):
        router = _router(renormalize)
        with kernels.use(route_weights=choice):
            runs[choice] = _router_step(router, x, upstream)
    (want, want_grad), (got, got_grad) = runs["torch"], runs["triton"]
    assert torch.equal(got.topk_ids_TK, want.topk_ids_TK)
    assert _rel(got.topk_weights_TK, want.topk_weights_TK) < FP32_TOL["twin"]
    assert _rel(got_grad, want_grad) < FP32_TOL["twin"]
    torch.testing.assert_close(got.scores_TE, want.scores_TE, rtol=0, atol=0)


def test_routing_replay_gives_the_routers_own_weights_and_trains_it():
    x = torch.randn(30, 40, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    upstream = torch.randn(30, 3, generator=torch.Generator().manual_seed(11)).to(DEVICE)

    class Model(torch.nn.Module):  # what RoutingReplay needs of a model: its routers
        def __init__(self):
            super().__init__()
            self.gate = _router()

        def routers(self):
            return [("gate", self.gate)]

    grads = {}
    for choice in ("torch", "triton"):
        model = Model()
        replay = RoutingReplay(model)
        with kernels.use(route_weights=choice):  # replaying the router's own experts: the very same weights
            with replay.record() as own:
                plain = model.gate(x)
            with replay.replay(own):
                again = model.gate(x)
        assert torch.equal(again.topk_weights_TK, plain.topk_weights_TK)
        routes = [[(5 * torch.arange(30)[:, None] + torch.arange(3)) % 12]]  # 3 distinct experts a token
        with kernels.use(route_weights=choice), replay.replay(routes):
            routing, grads[choice] = _router_step(model.gate, x, upstream)
        assert torch.equal(routing.topk_ids_TK, routes[0][0].to(DEVICE))
    assert grads["torch"].abs().sum() > 0
    assert _rel(grads["triton"], grads["torch"]) < FP32_TOL["twin"]


def _launches(choice, router, x, upstream):
    from bench.launch_census import Census, _recording_kernels

    census = Census()
    with kernels.use(route_weights=choice), _recording_kernels(census), census:
        _router_step(router, x, upstream)
    # tests/conftest.py fills every torch.empty with NaN: those fill_ launches are the test's, not the step's.
    return {kind: sum(n for line in getattr(census, kind).values() for op, n in line.ops.items() if op != "fill_")
            for kind in ("aten", "custom")}


@interpreted
@pytest.mark.parametrize("renormalize, fewer", [
    (True, 5 + 11),  # forward gather, sum, add, div, mul; backward mul, 7 for the division, new_zeros + scatter_add,
                     # sigmoid_backward
    (False, 2 + 4),  # forward gather, mul; backward mul, new_zeros + scatter_add, sigmoid_backward
])
def test_the_kernel_path_launches_fewer_kernels_by_the_census(renormalize, fewer):
    x, upstream = torch.randn(40, 40), torch.randn(40, 3)
    twin = _launches("torch", _router(renormalize), x, upstream)
    fused = _launches("triton", _router(renormalize), x, upstream)
    assert twin["aten"] - fused["aten"] == fewer
    assert fused["custom"] - twin["custom"] == 2  # the forward kernel and the backward kernel
    # With the auxiliary loss the scores need their gradient: the twin's ops stay.
    assert _launches("triton", _router(renormalize, aux_loss_coef=0.01), x, upstream) == \
        _launches("torch", _router(renormalize, aux_loss_coef=0.01), x, upstream)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA-graph capture needs a GPU")
def test_forward_and_backward_replay_in_a_cuda_graph():
    logits, ids, upstream = _case(16384, 64, 6, seed=12)
    leaf = logits.clone().requires_grad_()
    with kernels.use(route_weights="triton"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph compiles the kernels
            torch.autograd.grad(route_weights_triton(leaf, ids, True, 2.446), leaf, upstream)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            weights = route_weights_triton(leaf, ids, True, 2.446)
            (grad,) = torch.autograd.grad(weights, leaf, upstream)
    with torch.no_grad():
        leaf.copy_(torch.randn_like(leaf))
    graph.replay()
    want = _weights_and_grad(_twin, leaf, ids, upstream, True, 2.446)
    assert _rel(weights, want[0]) < FP32_TOL["twin"] and _rel(grad, want[1]) < FP32_TOL["twin"]
