"""QB's kernels (k3.ops.qb_triton) against their PyTorch twins, alone and inside the solver.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the tests
marked cuda compile them on a GPU.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from k3.config import ModelConfig  # noqa: E402
from k3.layers.balancing import solve_batch_bias, solve_batch_bias_on_device  # noqa: E402
from k3.layers.moe import Router  # noqa: E402
from k3.ops import qb_triton  # noqa: E402
from k3.ops.qb_triton import (kth_smallest_and_next_torch, kth_smallest_and_next_triton,  # noqa: E402
                              topk_with_load_torch, topk_with_load_triton)


def _scores(tokens, experts, seed=0, device="cpu"):
    """Sigmoid router scores [T, E] and a bias [E]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(tokens, experts, generator=g))
    return scores.to(device), (0.1 * torch.randn(experts, generator=g)).to(device)


def _lowest_id_first(scores_TE, bias_E, k, counted):
    """topk with ties in ascending expert id: a stable descending sort."""
    biased = scores_TE.float() + bias_E.float()
    values, indices = biased.sort(dim=-1, descending=True, stable=True)
    load = torch.bincount(indices[:, :counted].reshape(-1), minlength=biased.shape[1]).float()
    return values[:, :k], indices[:, :k], load


def _check_topk(scores, bias, k, counted):
    values, indices, load = topk_with_load_triton(scores, bias, k, counted)
    want = topk_with_load_torch(scores, bias, k, counted)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64 and load.dtype == torch.float32
    assert torch.equal(values, want.values)
    assert torch.equal(indices, want.indices)
    assert torch.equal(load, want.load_E)


@interpreted
@pytest.mark.parametrize("tokens", [0, 1, 5, 300])
@pytest.mark.parametrize("experts", [8, 64, 96, 256])
@pytest.mark.parametrize("k", [1, 7])
def test_topk_with_load_equals_torch(tokens, experts, k):
    scores, bias = _scores(tokens, experts, seed=tokens + experts + k)
    _check_topk(scores, bias, k, k - 1)
    if tokens == 5:  # the same with every pick counted, and with none
        _check_topk(scores, bias, k, k)
        _check_topk(scores, bias, k, 0)


@interpreted
def test_topk_reads_strides_and_other_dtypes():
    scores, bias = _scores(40, 24, seed=3)
    _check_topk(scores.t().contiguous().t(), bias, 5, 4)  # a transposed view: column-major scores
    _check_topk(scores[:, ::2], bias[::2], 3, 3)  # every other expert: a column stride of 2
    _check_topk(scores.bfloat16(), bias, 3, 2)  # widened to fp32 before the bias is added, as torch's is


@interpreted
def test_topk_ties_take_the_lowest_expert_first():
    """Scores on a grid of a few values tie often; the kernel orders tied experts by id (a stable sort's order),
    which torch.topk does not promise."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (64, 16), generator=g).float() / 4
    bias = torch.zeros(16)
    bias[3] = 0.25  # ties across the bias too
    values, indices, load = topk_with_load_triton(scores, bias, 7, 6)
    want_values, want_indices, want_load = _lowest_id_first(scores, bias, 7, 6)
    assert torch.equal(values, want_values)
    assert torch.equal(indices, want_indices)
    assert torch.equal(load, want_load)
    assert torch.equal(values, topk_with_load_torch(scores, bias, 7, 6).values)
    # Every score equal, -inf included: the first k ids, each once.
    for fill in (0.5, float("-inf")):
        values, indices, _ = topk_with_load_triton(torch.full((3, 12), fill), torch.zeros(12), 4, 4)
        assert indices.tolist() == [[0, 1, 2, 3]] * 3 and (values == fill).all()


def test_topk_bad_arguments_say_what_was_expected():
    scores = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"expected \[8\]"):
        topk_with_load_triton(scores, torch.zeros(7), 2, 2)
    with pytest.raises(ValueError, match="k=9"):
        topk_with_load_triton(scores, torch.zeros(8), 9, 2)
    with pytest.raises(ValueError, match="counted=3"):
        topk_with_load_triton(scores, torch.zeros(8), 2, 3)
    with pytest.raises(RuntimeError, match="no backward"):
        topk_with_load_triton(scores.requires_grad_(), torch.zeros(8), 2, 2)


def _check_kth(required, q, slices=None):
    qth, upper = kth_smallest_and_next_triton(required, q, slices)
    want_qth, want_upper = kth_smallest_and_next_torch(required, q)
    assert torch.equal(qth, want_qth), (qth, want_qth)
    assert torch.equal(upper, want_upper), (upper, want_upper)


@interpreted
# Each expert column is a program of its own (4 passes, each ~0.1 s interpreted): 300 rows over 4 columns, not 16
@pytest.mark.parametrize("tokens, experts", [(1, 4), (7, 3), (300, 4)])
def test_kth_and_next_equal_torch(tokens, experts):
    g = torch.Generator().manual_seed(tokens)
    required = torch.randn(tokens, experts, generator=g) * torch.logspace(-3, 1, experts)  # both signs, many scales
    for q in sorted({1, (tokens + 1) // 2, tokens}):
        for slices in (None, 2):
            _check_kth(required, q, slices)


@interpreted
def test_kth_and_next_over_columns_cut_into_slices():
    """1,000 rows in 4 slices of 256 rows (the last one short) and in 2 of 512 (whole blocks of the program's width):
    the digits found from summed per-slice histograms and the least key above taken across slices, ties at the
    q-th and the next larger value in another slice than the q-th included."""
    # Columns: distinct values, the next larger in the last slice, and ties (one column of each: every column is
    # a program of its own per slice, ~0.1 s a pass interpreted).
    g = torch.Generator().manual_seed(5)
    required = torch.cat([torch.randn(1000, 2, generator=g),
                          torch.randint(-3, 4, (1000, 2), generator=g)[:, :1].float() / 8], dim=1)
    required[:, 1] = torch.where(torch.arange(1000) < 900, -1.0, 2.0 ** -20)  # the next larger in the last slice
    for q in (1, 143, 500, 900, 901, 1000):
        for slices in (2, 4):
            _check_kth(required, q, slices)


@interpreted
def test_kth_and_next_with_ties_at_and_around_the_qth():
    g = torch.Generator().manual_seed(2)
    # 7 values, each ~29 times per column: drawn 6 wide so column 0 keeps its values; the sixth (a second such) left out
    required = torch.randint(-3, 4, (200, 6), generator=g)[:, :5].float() / 8
    required[:, 1] = 0.25  # one value only: no next larger (qth + 1.0)
    required[:, 2] = torch.where(required[:, 2] > 0, 0.0, -1.5)  # zeros and one negative value
    required[::2, 3] = -0.0  # -0.0 beside +0.0 and the rest
    required[:, 4] = torch.where(torch.arange(200) < 100, 1e-30, 1e-30 * (1 + 2 ** -23))  # one ulp apart
    for q in (1, 29, 30, 57, 100, 101, 199, 200):
        _check_kth(required, q)


@interpreted
def test_kth_and_next_read_strides():
    """A transposed view (columns contiguous) and a column slice: no copy in the launcher, same result."""
    required = torch.randn(9, 150, generator=torch.Generator().manual_seed(4)).t()
    _check_kth(required, 14)
    _check_kth(required[:, 2:7], 150)
    big = torch.tensor([[float("inf")], [1.0], [-float("inf")]])  # infinities: the twin's qth + 1.0 rule for +inf
    for q in (1, 2, 3):
        _check_kth(big, q)


def test_kth_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="slices=0"):
        kth_smallest_and_next_triton(torch.zeros(4, 3), 2, 0)
    with pytest.raises(ValueError, match="q=5"):
        kth_smallest_and_next_triton(torch.zeros(4, 3), 5)
    with pytest.raises(ValueError, match="fp32"):
        kth_smallest_and_next_triton(torch.zeros(4, 3, dtype=torch.float64), 2)


def test_auto_stays_on_pytorch_without_cuda(monkeypatch):
    monkeypatch.setenv("K3_QB_BACKEND", "auto")
    assert not qb_triton.qb_triton_pays(torch.zeros(2, 4))
    monkeypatch.setenv("K3_QB_BACKEND", "triton")
    assert qb_triton.qb_triton_pays(torch.zeros(2, 4))
    monkeypatch.setenv("K3_QB_BACKEND", "fused")
    with pytest.raises(ValueError, match="use auto, torch or triton"):
        qb_triton.qb_triton_pays(torch.zeros(2, 4))


def _skewed(tokens, experts, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(tokens, experts, generator=g) + torch.linspace(-1.0, 1.5, experts))


def _count_kernel_calls(monkeypatch) -> list:
    calls = []
    for name in ("topk_with_load_triton", "kth_smallest_and_next_triton"):
        kernel = getattr(qb_triton, name)
        monkeypatch.setattr(qb_triton, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    return calls


def _on_both_backends(monkeypatch, solve):
    calls = _count_kernel_calls(monkeypatch)
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3_QB_BACKEND", backend)
        bias, used = solve()
        results.append((bias, int(used)))
        assert set(calls) == (set() if backend == "torch" else {"topk_with_load_triton",
                                                                 "kth_smallest_and_next_triton"})
    (want, want_used), (got, used) = results
    assert torch.equal(got, want) and used == want_used
    return used


@interpreted
@pytest.mark.parametrize("seed", [0, 1])
def test_host_solver_gives_the_same_bias_and_count_on_either_backend(monkeypatch, seed):
    # 8 experts: the interpreted k-th-smallest kernel costs ~0.1 s per expert column per call (6 and 7 updates).
    scores = _skewed(256, 8, seed)
    used = _on_both_backends(monkeypatch, lambda: solve_batch_bias(scores, torch.zeros(8), 2, max_iters=12))
    assert 0 < used < 12  # balanced exactly after a few updates


@interpreted
def test_device_solver_gives_the_same_bias_and_count_on_either_backend(monkeypatch):
    scores = _skewed(256, 8, 2)
    used = _on_both_backends(monkeypatch, lambda: solve_batch_bias_on_device(scores, torch.zeros(8), 2, updates=4,
                                                                             tolerance=0.1))
    assert 0 < used < 4  # balanced within the updates; the ones after it computed and dropped


@interpreted
def test_router_routes_the_same_on_either_backend(monkeypatch):
    config = ModelConfig.from_preset("debug", hidden_size=32, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    calls = _count_kernel_calls(monkeypatch)
    got = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3_QB_BACKEND", backend)
        router = Router(config).train()
        router.balancing = "quantile"
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
        router.qb_max_iters = 8
        routing = router(x)
        assert router.last_qb_iters > 1, router.last_qb_iters  # a few updates, each through both kernels
        got[backend] = routing.topk_ids_TK, routing.topk_weights_TK, router.last_load_E, \
            router.e_score_correction_bias.clone()
    for want, have in zip(got["torch"], got["triton"]):
        assert torch.equal(want, have)
    # The solver's selections and updates, and the router's final selection with its load.
    assert calls.count("topk_with_load_triton") == 2 + router.last_qb_iters
    assert calls.count("kth_smallest_and_next_triton") == router.last_qb_iters


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("tokens", [1, 300, 16384])
@pytest.mark.parametrize("experts, k", [(8, 1), (64, 7), (96, 7), (256, 9)])
def test_topk_with_load_equals_torch_cuda(tokens, experts, k):
    scores, bias = _scores(tokens, experts, seed=tokens + experts, device="cuda")
    values, indices, load = topk_with_load_triton(scores, bias, k, k - 1)
    want = topk_with_load_torch(scores, bias, k, k - 1)
    assert torch.equal(values, want.values)
    # torch.topk's order among exactly tied scores is unspecified: compare with ties ordered by id.
    _, want_indices, want_load = _lowest_id_first(scores, bias, k, k - 1)
    assert torch.equal(indices, want_indices)
    assert torch.equal(load, want_load)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("tokens, experts", [(1, 4), (300, 16), (16384, 64), (131072, 64)])
def test_kth_and_next_equal_torch_cuda(tokens, experts):
    g = torch.Generator().manual_seed(tokens)
    required = (torch.randn(tokens, experts, generator=g) * torch.logspace(-3, 1, experts)).cuda()
    ties = (torch.randint(-3, 4, (tokens, experts), generator=g).float() / 8).cuda()
    for matrix in (required, ties, required.t().contiguous().t()):
        for q in sorted({1, max(1, tokens * 6 // experts), tokens}):
            _check_kth(matrix, q)


@pytest.mark.cuda
@cuda
def test_solver_same_bias_on_either_backend_cuda(monkeypatch):
    scores, start = _skewed(4096, 64, 0).cuda(), torch.zeros(64, device="cuda")
    solved = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3_QB_BACKEND", backend)
        bias, used = solve_batch_bias_on_device(scores, start, 6, updates=8, tolerance=0.01)
        solved[backend] = bias, int(used)
    assert torch.equal(solved["torch"][0], solved["triton"][0]) and solved["torch"][1] == solved["triton"][1]


@pytest.mark.cuda
@cuda
def test_kernels_capture_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("K3_QB_BACKEND", "triton")
    scores, bias = _scores(2048, 64, seed=5, device="cuda")
    required = scores - 0.5
    topk_with_load_triton(scores, bias, 7, 6)  # compiled before capture
    kth_smallest_and_next_triton(required, 192)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top = topk_with_load_triton(scores, bias, 7, 6)
        kth = kth_smallest_and_next_triton(required, 192)
    scores.copy_(_scores(2048, 64, seed=6, device="cuda")[0])
    required.copy_(scores - 0.25)
    graph.replay()
    want = topk_with_load_torch(scores, bias, 7, 6)
    assert torch.equal(top[0], want.values) and torch.equal(top[2], want.load_E)
    want_kth = kth_smallest_and_next_torch(required, 192)
    assert torch.equal(kth[0], want_kth[0]) and torch.equal(kth[1], want_kth[1])
