"""k3's RMSNorm Triton kernels (k3.ops.rms_norm_triton) against an fp64 oracle and the PyTorch twin
(k3.ops.norm.rms_norm_torch): the output and the gradients of x and weight under random upstream gradients; the
K3_RMS_NORM switch in k3.ops.norm; and the debug model's loss and every gradient with the switch on and off.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Shapes are
small and ragged: D not a multiple of the block, rows not a multiple of the rows per program, both kernels' paths
(the whole row in one chunk, and rows in several chunks) and backward programs that loop over several row blocks.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import k3.ops.norm as norm_ops  # noqa: E402
import k3.ops.rms_norm_triton as launcher  # noqa: E402
from k3.ops.norm import rms_norm, rms_norm_torch  # noqa: E402
from k3.ops.rms_norm_triton import Blocks, rms_norm_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
EPS = 1e-5
# Rows in chunks of 32 (several, the last ragged), 4 rows per program, 2 backward programs summing dw over several
# row blocks each; and the whole row in one chunk (the default path), 2 rows per program, 3 backward programs.
CHUNKED = Blocks(block_n=4, block_d=32, num_warps=4, programs=2)


def whole_row(dim: int) -> Blocks:
    return Blocks(block_n=2, block_d=max(16, 1 << (dim - 1).bit_length()), num_warps=4, programs=3)


def reference(x, weight, eps):
    """The formula in fp64 on the (rounded) input values, differentiable."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _inputs(shape, dtype, weight_dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(device, dtype).requires_grad_()
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(device, weight_dtype).requires_grad_()
    upstream = torch.randn(shape, generator=g).to(device, dtype)
    return x, weight, upstream


def _run(fn, x, weight, upstream):
    out = fn(x, weight, EPS)
    return [out, *torch.autograd.grad(out, [x, weight], upstream.to(out.dtype))]


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dim, rows, dtype, weight_dtype", [
    (40, 33, torch.float32, torch.float32),
    (130, 7, torch.float32, torch.float32),
    (1000, 1, torch.float32, torch.float32),
    (130, 33, torch.bfloat16, torch.float32),
    (40, 7, torch.bfloat16, torch.bfloat16),
    (1000, 7, torch.bfloat16, torch.bfloat16),
    (130, 7, torch.float16, torch.float32),
])
@pytest.mark.parametrize("path", ["chunked", "whole_row", "default"])
def test_kernels_equal_the_oracle_and_the_twin(dim, rows, dtype, weight_dtype, path):
    blocks = {"chunked": CHUNKED, "whole_row": whole_row(dim), "default": None}[path]
    x, weight, upstream = _inputs((rows, dim), dtype, weight_dtype, seed=dim + rows)
    got = _run(lambda *a: rms_norm_triton(*a, blocks=blocks, backward_blocks=blocks), x, weight, upstream)
    twin = _run(rms_norm_torch, x, weight, upstream)
    oracle = _run(reference, x, weight, upstream)
    assert got[0].dtype == dtype and got[0].shape == x.shape
    assert got[1].dtype == dtype and got[2].dtype == weight_dtype
    # bf16/fp16: y and dx are rounded to their dtype (~2e-3 from the oracle in bf16). The twin rounds the same
    # fp32 values to nearest, so it differs only where fp32 summation order flips a rounding.
    oracle_tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    twin_tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}
    tols = [(oracle_tol[dtype], twin_tol[dtype])] * 2 + [(oracle_tol[weight_dtype], twin_tol[weight_dtype])]
    for name, a, t, o, (o_tol, t_tol) in zip(["y", "dx", "dweight"], got, twin, oracle, tols):
        assert torch.isfinite(a).all(), name
        assert _rel(a, o) < o_tol, f"{name}: {_rel(a, o):.2e} from the fp64 oracle"
        assert _rel(a, t) < t_tol, f"{name}: {_rel(a, t):.2e} from the twin"


@pytest.mark.parametrize("path", ["chunked", "whole_row"])
def test_eps_counts_for_rows_of_small_scale(path):
    """mean(x^2) ~ 1e-6 next to eps = 1e-5: eps moves y and both gradients by far more than the tolerance."""
    x, weight, upstream = _inputs((9, 72), torch.float32, seed=8)
    x = (x.detach() * 1e-3).requires_grad_()
    blocks = CHUNKED if path == "chunked" else whole_row(72)
    got = _run(lambda *a: rms_norm_triton(*a, blocks=blocks, backward_blocks=blocks), x, weight, upstream)
    for name, a, o in zip(["y", "dx", "dweight"], got, _run(reference, x, weight, upstream)):
        assert _rel(a, o) < 1e-5, f"{name}: {_rel(a, o):.2e} from the fp64 oracle"


def test_bf16_output_rounds_to_nearest_like_the_twin():
    """In bf16 the kernels' y is the twin's bit for bit at a small D (one fp32 sum order): the interpreter's
    truncating cast is rounded first (k3.ops.triton_cast), as a GPU rounds."""
    x, weight, upstream = _inputs((5, 24), torch.bfloat16, seed=11)
    with torch.no_grad():
        assert torch.equal(rms_norm_triton(x, weight, EPS), rms_norm_torch(x, weight, EPS))


def test_three_d_and_non_contiguous_input():
    """A [B, T, D] input keeps its shape; a transposed view (rows not D apart) is copied, and its gradient still
    reaches it in its own layout."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(9, 2, 48, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.rand(48, generator=g) + 0.5).to(DEVICE).requires_grad_()
    upstream = torch.randn(2, 9, 48, generator=g).to(DEVICE)
    x = base.transpose(0, 1)
    assert not x.is_contiguous()
    out = rms_norm_triton(x, weight, EPS)
    assert out.shape == (2, 9, 48)
    got = torch.autograd.grad(out, [base, weight], upstream)
    want = torch.autograd.grad(reference(x, weight, EPS), [base, weight], upstream.double())
    torch.testing.assert_close(out.double(), reference(x, weight, EPS), rtol=1e-5, atol=1e-5)
    for name, a, w in zip(["d base", "d weight"], got, want):
        assert a.shape == w.shape
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5, msg=name)


def test_no_grad_keeps_no_statistics(monkeypatch):
    saved = []
    forward = launcher.norm_forward

    def recorded(x_ND, weight_D, eps, save, blocks=None, gate_ND=None):
        saved.append(save)
        return forward(x_ND, weight_D, eps, save, blocks, gate_ND)

    monkeypatch.setattr(launcher, "norm_forward", recorded)
    x, weight, _ = _inputs((3, 5, 40), torch.float32, seed=2)
    with torch.no_grad():
        out = rms_norm_triton(x, weight, EPS)
    assert out.grad_fn is None and saved == [False]
    torch.testing.assert_close(out, rms_norm_torch(x, weight, EPS).detach())
    rms_norm_triton(x, weight, EPS)
    assert saved == [False, True]


def test_weight_gradient_alone_and_input_gradient_alone():
    x, weight, upstream = _inputs((7, 40), torch.float32, seed=4)
    dw = torch.autograd.grad(rms_norm_triton(x.detach(), weight, EPS), weight, upstream)[0]
    dx = torch.autograd.grad(rms_norm_triton(x, weight.detach(), EPS), x, upstream)[0]
    want = torch.autograd.grad(reference(x, weight, EPS), [x, weight], upstream.double())
    torch.testing.assert_close(dx, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, want[1], rtol=1e-5, atol=1e-5)


def test_no_rows():
    x = torch.randn(0, 4, 24, device=DEVICE, requires_grad=True)
    weight = torch.ones(24, device=DEVICE, requires_grad=True)
    out = rms_norm_triton(x, weight, EPS)
    assert out.shape == (0, 4, 24)
    grads = torch.autograd.grad(out.sum(), [x, weight])
    assert all(g.shape == t.shape and not g.abs().sum() for g, t in zip(grads, [x, weight]))
    with torch.no_grad():
        assert rms_norm_triton(x, weight, EPS).shape == (0, 4, 24)


def test_rejects_what_it_cannot_normalise():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[8\]"):
        rms_norm_triton(x, torch.ones(9, device=DEVICE), EPS)
    with pytest.raises(ValueError, match=r"must be \[8\]"):
        rms_norm_triton(x, torch.ones(3, 8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="kernels take"):
        rms_norm_triton(x.double(), torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="kernels take"):
        rms_norm_triton(x, torch.ones(8, device=DEVICE, dtype=torch.float64), EPS)
    with pytest.raises(ValueError, match="scalar"):
        rms_norm_triton(torch.tensor(1.0, device=DEVICE), torch.ones(1, device=DEVICE), EPS)


def _counting(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return rms_norm_triton(*args, **kwargs)

    monkeypatch.setattr(norm_ops, "rms_norm_triton", counted)
    return calls


def _set_choice(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("K3_RMS_NORM", raising=False)
    else:
        monkeypatch.setenv("K3_RMS_NORM", value)


@pytest.mark.parametrize("value", [None, "", "auto", "AUTO ", "fla"])
def test_cpu_tensors_keep_the_twin_unless_forced(monkeypatch, value):
    """auto (the default) sends only CUDA tensors to the kernels; fla never does: CPU tensors take the twin."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton launcher was called for CPU tensors without K3_RMS_NORM=triton")

    monkeypatch.setattr(norm_ops, "rms_norm_triton", refuse)
    _set_choice(monkeypatch, value)
    x, weight, upstream = _inputs((2, 3, 40), torch.float32, seed=6, device="cpu")
    for a, t in zip(_run(rms_norm, x, weight, upstream), _run(rms_norm_torch, x, weight, upstream)):
        torch.testing.assert_close(a, t, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="auto chooses the kernels for CUDA tensors only")
@pytest.mark.parametrize("value", [None, "auto"])
def test_auto_runs_the_kernels_on_cuda(monkeypatch, value):
    calls = _counting(monkeypatch)
    _set_choice(monkeypatch, value)
    x, weight, upstream = _inputs((2, 3, 40), torch.bfloat16, seed=7)
    got = _run(rms_norm, x, weight, upstream)
    assert calls == [(2, 3, 40)]
    for name, a, t in zip(["y", "dx", "dweight"], got, _run(rms_norm_torch, x, weight, upstream)):
        assert _rel(a, t) < 1e-3, name


@pytest.mark.skipif(DEVICE != "cuda", reason="the fla / twin choice matters for CUDA tensors only")
@pytest.mark.parametrize("value", ["fla", "auto"])
def test_fla_choice_or_torch_fused_backend_keeps_the_kernels_off_on_cuda(monkeypatch, value):
    from k3.ops.fused_backend import set_fused_backend

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton launcher was called")

    monkeypatch.setattr(norm_ops, "rms_norm_triton", refuse)
    _set_choice(monkeypatch, value)
    set_fused_backend("torch" if value == "auto" else None)
    try:
        x, weight, upstream = _inputs((2, 3, 40), torch.bfloat16, seed=8)
        _run(rms_norm, x, weight, upstream)
    finally:
        set_fused_backend(None)


def test_switch_triton_runs_the_kernels(monkeypatch):
    calls = _counting(monkeypatch)
    monkeypatch.setenv("K3_RMS_NORM", "triton")
    x, weight, upstream = _inputs((2, 3, 40), torch.bfloat16, seed=7)
    got = _run(rms_norm, x, weight, upstream)
    assert calls == [(2, 3, 40)]
    for name, a, t in zip(["y", "dx", "dweight"], got, _run(rms_norm_torch, x, weight, upstream)):
        assert _rel(a, t) < 1e-3, name
    with torch.no_grad():  # fp64 is not the kernels': today's path takes it
        rms_norm(x.double(), weight.double(), EPS)
    assert len(calls) == 1


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("K3_RMS_NORM", "liger")
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="K3_RMS_NORM='liger'; use auto, torch, triton or fla"):
        rms_norm(x, torch.ones(8, device=DEVICE), EPS)


def test_inside_torch_compile_the_launcher_is_never_called(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton launcher was called inside torch.compile")

    monkeypatch.setattr(norm_ops, "rms_norm_triton", refuse)
    monkeypatch.setenv("K3_RMS_NORM", "triton")
    x, weight, _ = _inputs((2, 3, 16), torch.float32, seed=9)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda a, w: rms_norm(a, w, EPS), backend="eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(x, weight)
    finally:
        torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(out, rms_norm_torch(x, weight, EPS))


@pytest.mark.parametrize("path", ["chunked", "whole_row"])
def test_dweight_partial_rows_need_no_zeroed_buffer(monkeypatch, path):
    """The launcher allocates dw's per-program rows uninitialised (no zero-fill launch): filled with NaN here, as
    reused memory may be, the weight's gradient still equals the twin's."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    blocks = {"chunked": CHUNKED, "whole_row": whole_row(130)}[path]
    x, weight, upstream = _inputs((33, 130), torch.float32, seed=3)
    got = _run(lambda *a: rms_norm_triton(*a, blocks=blocks, backward_blocks=blocks), x, weight, upstream)
    twin = _run(rms_norm_torch, x, weight, upstream)
    assert torch.isfinite(got[2]).all()
    assert _rel(got[2], twin[2]) < 1e-5
