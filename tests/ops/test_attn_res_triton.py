"""The AttnRes Triton kernels (k3.ops.attn_res_triton) against an fp64 oracle and the eager twin: the mix and
the gradients of every source, norm_weight and query, under random upstream gradients.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Shapes are
small and ragged: D not a multiple of the block, tokens not a multiple of the rows per program, programs that
loop over several row blocks, source counts that are not powers of two (padded softmax columns).
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import k3.ops.attn_res as attn_res_ops  # noqa: E402
from k3.ops.attn_res import attn_res_backend, attn_res_mix, attn_res_mix_eager, set_attn_res_backend  # noqa: E402
from k3.ops.attn_res_triton import Blocks, attn_res_mix_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
EPS = 1e-5
# D in chunks of 32 and 4 rows per program, 2 backward programs: several chunks with a ragged last one, a ragged
# last row block, and each backward program summing dq over several blocks.
SMALL = Blocks(block_n=4, block_d=32, num_warps=4, programs=2)


def _small(*args):
    return attn_res_mix_triton(*args, blocks=SMALL, backward_blocks=SMALL)


def reference(sources, norm_w, query, eps):
    """The formula in fp64 (tests/ops/test_attn_res_ops.py's oracle), differentiable."""
    q = norm_w.double() * query.double()
    values = [v.double() for v in sources]
    scores = torch.stack([(v @ q) / v.pow(2).mean(-1).add(eps).sqrt() for v in values])
    return (scores.softmax(0).unsqueeze(-1) * torch.stack(values)).sum(0)


def _inputs(count, dim, tokens, dtype, scales=None, query_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = scales or [1.0 + 0.5 * i for i in range(count)]
    sources = [(torch.randn(1, tokens, dim, generator=g) * scales[i]).to(DEVICE, dtype).requires_grad_()
               for i in range(count)]
    norm_w = (torch.rand(dim, generator=g) + 0.5).to(DEVICE).requires_grad_()
    query = (torch.randn(dim, generator=g) * query_scale).to(DEVICE).requires_grad_()
    upstream = torch.randn(1, tokens, dim, generator=g).to(DEVICE, dtype)
    return sources, norm_w, query, upstream


def _run(fn, sources, norm_w, query, upstream):
    out = fn(sources, norm_w, query, EPS)
    return [out, *torch.autograd.grad(out, [*sources, norm_w, query], upstream.to(out.dtype))]


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _names(count):
    return ["mix", *(f"d source {i}" for i in range(count)), "d norm_weight", "d query"]


@pytest.mark.parametrize("count, dim, tokens, dtype", [
    (2, 40, 13, torch.float32),
    (3, 130, 13, torch.float32),
    (5, 40, 7, torch.bfloat16),
    (9, 130, 13, torch.bfloat16),
    (16, 40, 5, torch.float32),  # past the full K3 config's ~10 sources
])
def test_kernels_equal_the_oracle_and_the_eager_twin(count, dim, tokens, dtype):
    sources, norm_w, query, upstream = _inputs(count, dim, tokens, dtype)
    got = _run(_small, sources, norm_w, query, upstream)
    eager = _run(attn_res_mix_eager, sources, norm_w, query, upstream)
    oracle = _run(reference, sources, norm_w, query, upstream)  # the bf16 values themselves, in fp64
    assert got[0].dtype == dtype and got[0].shape == sources[0].shape
    assert all(g.dtype == s.dtype for g, s in zip(got[1:], sources))
    # bf16: the mix and the source gradients are rounded to bf16 (~2e-3 from the oracle). The twin rounds the
    # same fp32 values to nearest, so it differs where fp32 summation order flips a rounding (a cast that
    # truncated would be ~5e-3 away).
    oracle_tol, twin_tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-3)
    for name, a, e, o in zip(_names(count), got, eager, oracle):
        assert torch.isfinite(a).all(), name
        assert _rel(a, o) < oracle_tol, f"{name}: {_rel(a, o):.2e} from the fp64 oracle"
        assert _rel(a, e) < twin_tol, f"{name}: {_rel(a, e):.2e} from the eager twin"
    for name, a, o in zip(_names(count)[-2:], got[-2:], oracle[-2:]):  # fp32 in both dtypes
        assert _rel(a, o) < 1e-5, f"{name}: {_rel(a, o):.2e} from the fp64 oracle"


def test_saturated_softmax_over_sources_of_very_different_scale():
    """Scores of hundreds: alpha is one-hot up to exp(-100)s. dq then cancels badly in fp32 (the eager twin is
    ~2e-2 from the oracle there too), so the kernels may be no further from the oracle than twice the twin."""
    sources, norm_w, query, upstream = _inputs(4, 72, 11, torch.float32, scales=[1e-3, 1.0, 30.0, 1e3],
                                               query_scale=50.0, seed=3)
    got = _run(_small, sources, norm_w, query, upstream)
    eager = _run(attn_res_mix_eager, sources, norm_w, query, upstream)
    oracle = _run(reference, sources, norm_w, query, upstream)
    for name, a, e, o in zip(_names(4), got, eager, oracle):
        assert torch.isfinite(a).all(), name
        assert _rel(a, o) <= 2 * _rel(e, o) + 1e-5, f"{name}: {_rel(a, o):.2e}, eager {_rel(e, o):.2e}"


def test_default_blocks_without_grad_and_non_contiguous_sources():
    """Default launch shape; under no_grad the forward keeps no statistics; a source whose rows are not D apart
    (a transposed view) is copied, and its gradient still reaches it."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(9, 2, 48, generator=g).to(DEVICE).requires_grad_()
    other = torch.randn(2, 9, 48, generator=g).to(DEVICE).requires_grad_()
    norm_w = (torch.rand(48, generator=g) + 0.5).to(DEVICE).requires_grad_()
    query = torch.randn(48, generator=g).to(DEVICE).requires_grad_()
    upstream = torch.randn(2, 9, 48, generator=g).to(DEVICE)
    with torch.no_grad():
        sources = [base.transpose(0, 1), other]
        torch.testing.assert_close(attn_res_mix_triton(sources, norm_w, query, EPS),
                                   attn_res_mix_eager(sources, norm_w, query, EPS), rtol=1e-5, atol=1e-5)
    leaves = [base, other, norm_w, query]
    got = torch.autograd.grad(attn_res_mix_triton([base.transpose(0, 1), other], norm_w, query, EPS), leaves,
                              upstream)
    want = torch.autograd.grad(reference([base.transpose(0, 1), other], norm_w, query, EPS), leaves,
                               upstream.double())
    for name, a, w in zip(["d base", "d other", "d norm_weight", "d query"], got, want):
        torch.testing.assert_close(a.double(), w.double(), rtol=1e-5, atol=1e-5, msg=name)


def test_no_tokens():
    sources = [torch.randn(0, 4, 24, device=DEVICE, requires_grad=True) for _ in range(3)]
    norm_w, query = torch.ones(24, device=DEVICE, requires_grad=True), torch.randn(24, device=DEVICE)
    out = attn_res_mix_triton(sources, norm_w, query, EPS)
    assert out.shape == (0, 4, 24)
    grads = torch.autograd.grad(out.sum(), [*sources, norm_w])
    assert all(g.shape == t.shape and not g.abs().sum() for g, t in zip(grads, [*sources, norm_w]))


def test_rejects_what_it_cannot_mix():
    x = torch.randn(1, 3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="must match source 0"):
        attn_res_mix_triton([x, x.bfloat16()], w, w, EPS)
    with pytest.raises(ValueError, match="kernels take"):
        attn_res_mix_triton([x.double(), x.double()], w, w, EPS)
    with pytest.raises(ValueError, match=r"must both be \[8\]"):
        attn_res_mix_triton([x, x], torch.ones(9, device=DEVICE), w, EPS)


def test_dispatch_forced_to_triton_runs_the_kernels(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return attn_res_mix_triton(*args, **kwargs)

    monkeypatch.setattr(attn_res_ops, "attn_res_mix_triton", counted)
    sources, norm_w, query, upstream = _inputs(3, 40, 6, torch.float32, seed=7)
    set_attn_res_backend("triton")
    try:
        assert attn_res_backend(sources[0]) == "triton"
        got = _run(attn_res_mix, sources, norm_w, query, upstream)
    finally:
        set_attn_res_backend(None)
    assert calls == [3]
    for name, a, e in zip(_names(3), got, _run(attn_res_mix_eager, sources, norm_w, query, upstream)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_mixed_dtype_sources_mix_as_the_eager_path_does(monkeypatch, backend):
    """Autocast training: the embedding (source 0) is fp32, the layers' outputs bf16. The dispatcher promotes
    them to one dtype for the kernels; mix and gradients (each in its source's dtype) equal the eager path's."""
    sources, norm_w, query, upstream = _inputs(3, 40, 6, torch.float32, seed=11)
    sources = [sources[0]] + [s.detach().bfloat16().requires_grad_() for s in sources[1:]]
    calls = []

    def counted(*args, **kwargs):
        calls.append({s.dtype for s in args[0]})
        return attn_res_mix_triton(*args, **kwargs)

    monkeypatch.setattr(attn_res_ops, "attn_res_mix_triton", counted)
    if backend == "auto":  # what a CUDA tensor gets; on CPU the interpreter stands in for the GPU
        monkeypatch.setattr(attn_res_ops, "attn_res_backend", lambda x=None: "triton" if x is not None else "auto")
    set_attn_res_backend("triton" if backend == "triton" else None)
    try:
        got = _run(attn_res_mix, sources, norm_w, query, upstream)
    finally:
        set_attn_res_backend(None)
    assert calls == [{torch.float32}]
    want = _run(attn_res_mix_eager, sources, norm_w, query, upstream)
    assert got[0].dtype == torch.float32 and [g.dtype for g in got[1:4]] == [s.dtype for s in sources]
    for name, a, e in zip(_names(3), got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


def test_auto_backend_by_device():
    assert attn_res_backend(torch.zeros(1)) == "torch"
    if torch.cuda.is_available():
        assert attn_res_backend(torch.zeros(1, device="cuda")) == "triton"
        assert attn_res_backend(torch.zeros(1, device="cuda", dtype=torch.float64)) == "compiled"


def test_inside_torch_compile_the_eager_formula_is_traced(monkeypatch):
    """A compiled decode step traces the mix into its own graph, whatever the backend: the launcher is never
    called while dynamo traces."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton launcher was called inside torch.compile")

    monkeypatch.setattr(attn_res_ops, "attn_res_mix_triton", refuse)
    sources, norm_w, query, _ = _inputs(2, 16, 3, torch.float32, seed=9)
    set_attn_res_backend("triton")
    try:
        torch._dynamo.reset()
        compiled = torch.compile(lambda s, w, q: attn_res_mix(s, w, q, EPS), backend="eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(sources, norm_w, query)
    finally:
        set_attn_res_backend(None)
        torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(out, attn_res_mix_eager(sources, norm_w, query, EPS))


def test_auto_selected_kernel_that_fails_to_compile_falls_back_to_the_twin(monkeypatch):
    """Chosen by auto (not forced), a Triton compile failure warns once and the twin serves that variant."""
    from k3.ops import attn_res as dispatch
    from k3.ops.fused_backend import _failed

    class CompilationError(Exception):  # Triton's name; is_triton_compile_failure goes by it
        pass

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise CompilationError("PassManager::run failed")

    monkeypatch.setattr(dispatch, "attn_res_backend", lambda x=None: "auto" if x is None else "triton")
    monkeypatch.setattr(dispatch, "attn_res_mix_triton", failing)
    # On DEVICE: with a GPU, CPU tensors under a forced "triton" choice are refused (no interpreter there).
    sources = [torch.randn(2, 3, 24, device=DEVICE) for _ in range(3)]
    norm_w, query = torch.rand(24, device=DEVICE) + 0.5, torch.randn(24, device=DEVICE)
    want = dispatch.attn_res_mix_eager(sources, norm_w, query, 1e-5)
    try:
        with pytest.warns(RuntimeWarning, match="failed to compile"):
            torch.testing.assert_close(dispatch.attn_res_mix(sources, norm_w, query, 1e-5), want)
        torch.testing.assert_close(dispatch.attn_res_mix(sources, norm_w, query, 1e-5), want)
        assert calls == [1]  # the second call went straight to the twin
    finally:
        _failed.pop(("attn_res_triton", 3, 24, torch.float32), None)


def test_auto_leaves_more_sources_than_the_kernels_unroll_to_the_compiled_mix(monkeypatch):
    from k3.ops import attn_res as dispatch
    from k3.ops.attn_res_triton import MAX_SOURCES

    taken = []
    monkeypatch.setattr(dispatch, "attn_res_backend", lambda x=None: "auto" if x is None else "triton")
    monkeypatch.setattr(dispatch, "attn_res_mix_triton", lambda *a, **k: taken.append("triton"))
    monkeypatch.setattr(dispatch, "attn_res_mix_compiled", lambda *a: taken.append("compiled"))
    norm_w, query = torch.rand(8, device=DEVICE), torch.randn(8, device=DEVICE)
    for count in (MAX_SOURCES, MAX_SOURCES + 1):
        dispatch.attn_res_mix([torch.randn(1, 2, 8, device=DEVICE) for _ in range(count)], norm_w, query, 1e-5)
    assert taken == ["triton", "compiled"]


def test_dquery_partial_rows_need_no_zeroed_buffer(monkeypatch):
    """The launcher allocates dq's per-program rows uninitialised (each program zeroes its own): filled with NaN
    here, as reused memory may be, the query's and norm weight's gradients still equal the twin's."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    sources, norm_w, query, upstream = _inputs(3, 130, 13, torch.float32, seed=5)
    got = _run(_small, sources, norm_w, query, upstream)
    eager = _run(attn_res_mix_eager, sources, norm_w, query, upstream)
    for name, a, e in zip(_names(3)[-2:], got[-2:], eager[-2:]):
        assert torch.isfinite(a).all(), name
        assert _rel(a, e) < 1e-5, f"{name}: {_rel(a, e):.2e} from the eager twin"
