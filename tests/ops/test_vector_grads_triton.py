"""k3.ops.vector_grads: the [D] weight gradients' last steps (sum over a backward kernel's partial rows, products,
casts) as one Triton kernel, against an fp64 oracle and the PyTorch twin; the RMSNorm and AttnRes mix kernels'
outputs and every gradient with the switch at `triton` and at `torch`; and, counted by bench/launch_census.py's
recorder, that the kernel path launches fewer kernels.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from k3 import kernels  # noqa: E402
from k3.ops import vector_grads  # noqa: E402
from k3.ops.attn_res import attn_res_mix_eager  # noqa: E402
from k3.ops.attn_res_triton import attn_res_mix_triton  # noqa: E402
from k3.ops.norm import rms_norm_torch  # noqa: E402
from k3.ops.rms_norm_triton import rms_norm_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("rows,dim", [(1, 16), (5, 300), (9, 1024), (70, 130)])  # ragged column and row tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summed_rows_times_matches_the_fp64_oracle_and_the_twin(rows, dim, dtype):
    g = torch.Generator().manual_seed(rows * dim)
    partials = torch.randn(rows, dim, generator=g).to(DEVICE)
    a, b = (torch.randn(dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    exact = partials.double().sum(0)
    oracle = [exact * a.double(), exact * b.double()]
    with kernels.use(vector_grads="triton"):
        fused = vector_grads.summed_rows_times(partials, a, b, dtype, torch.float32)
        summed = vector_grads.summed_rows(partials, dtype)
        product = vector_grads.product(a, b)
    with kernels.use(vector_grads="torch"):
        twin = vector_grads.summed_rows_times(partials, a, b, dtype, torch.float32)
        twin_summed = vector_grads.summed_rows(partials, dtype)
        twin_product = vector_grads.product(a, b)
    assert [t.dtype for t in fused] == [dtype, torch.float32] and summed.dtype == dtype
    assert product.dtype == torch.float32
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding of the output
    for got, want in zip(fused, oracle):
        assert _rel(got, want) < tol
    assert _rel(summed, exact) < tol
    assert torch.equal(product, twin_product)  # one fp32 product: no order to differ in
    for got, want in zip((*fused, summed), (*twin, twin_summed)):
        assert _rel(got, want) < tol


def test_a_vector_of_the_wrong_length_is_refused():
    with kernels.use(vector_grads="triton"), pytest.raises(ValueError, match=r"must be \[8\]"):
        vector_grads.summed_rows_times(torch.zeros(2, 8, device=DEVICE), torch.zeros(7, device=DEVICE),
                                       torch.zeros(8, device=DEVICE), torch.float32, torch.float32)


def _mix_case(dtype):
    g = torch.Generator().manual_seed(1)
    sources = [(torch.randn(2, 37, 96, generator=g)).to(DEVICE, dtype).requires_grad_() for _ in range(3)]
    norm_weight = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE, dtype).requires_grad_()
    query = (0.3 * torch.randn(96, generator=g)).to(DEVICE, dtype).requires_grad_()
    upstream = torch.randn(2, 37, 96, generator=g).to(DEVICE, dtype)
    return sources, norm_weight, query, upstream


def _out_and_grads(fn, sources, norm_weight, query, upstream):
    out = fn(sources, norm_weight, query, 1e-6)
    leaves = [*sources, norm_weight, query]
    return [out, *torch.autograd.grad(out, leaves, upstream.to(out.dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_with_the_kernel_matches_the_oracle_and_the_twin_path(dtype):
    sources, norm_weight, query, upstream = _mix_case(dtype)
    oracle = _out_and_grads(attn_res_mix_eager, [s.detach().double().requires_grad_() for s in sources],
                            norm_weight.detach().double().requires_grad_(),
                            query.detach().double().requires_grad_(), upstream.double())
    with kernels.use(vector_grads="triton"):
        fused = _out_and_grads(attn_res_mix_triton, sources, norm_weight, query, upstream)
    with kernels.use(vector_grads="torch"):
        twin = _out_and_grads(attn_res_mix_triton, sources, norm_weight, query, upstream)
    names = ["out", "d source 0", "d source 1", "d source 2", "d norm_weight", "d query"]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, want, ref in zip(names, fused, twin, oracle):
        assert got.dtype == want.dtype, name
        assert _rel(got, ref) < tol, (name, _rel(got, ref))
        assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 8e-3), (name, _rel(got, want))
    for name, got, want in zip(names[:4], fused[:4], twin[:4]):
        assert torch.equal(got, want), name  # the kernel changes only the [D] vectors' last steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_weight_gradient_with_the_kernel_matches_the_oracle_and_the_twin_path(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 41, 160, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(160, generator=g)).to(DEVICE, dtype).requires_grad_()
    upstream = torch.randn(3, 41, 160, generator=g).to(DEVICE, dtype)

    def run(fn, x, weight, upstream):
        y = fn(x, weight, 1e-6)
        return [y, *torch.autograd.grad(y, [x, weight], upstream.to(y.dtype))]

    oracle = run(rms_norm_torch, x.detach().double().requires_grad_(), weight.detach().double().requires_grad_(),
                 upstream.double())
    with kernels.use(vector_grads="triton"):
        fused = run(rms_norm_triton, x, weight, upstream)
    with kernels.use(vector_grads="torch"):
        twin = run(rms_norm_triton, x, weight, upstream)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, want, ref in zip(["y", "dx", "dw"], fused, twin, oracle):
        assert got.dtype == want.dtype == dtype, name
        assert _rel(got, ref) < tol, (name, _rel(got, ref))
    assert torch.equal(fused[0], twin[0]) and torch.equal(fused[1], twin[1])
    assert _rel(fused[2], twin[2]) < (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the census records the interpreter's launches")
def test_the_kernel_path_launches_fewer_kernels_by_the_census():
    from bench.launch_census import Census, _recording_kernels

    sources, norm_weight, query, upstream = _mix_case(torch.bfloat16)
    x = torch.randn(2, 37, 96, dtype=torch.bfloat16, requires_grad=True)

    def launches(choice):
        census = Census()
        with kernels.use(vector_grads=choice), _recording_kernels(census), census:
            _out_and_grads(attn_res_mix_triton, sources, norm_weight, query, upstream)
            y = rms_norm_triton(x, norm_weight, 1e-6)
            torch.autograd.grad(y, [x, norm_weight], upstream)
        # tests/conftest.py fills every torch.empty with NaN: those fill_ launches are the test's, not the step's.
        return {kind: sum(n for line in getattr(census, kind).values() for op, n in line.ops.items() if op != "fill_")
                for kind in ("aten", "custom")}

    twin, fused = launches("torch"), launches("triton")
    # The mix: 3 ops for q in its forward and 7 for its [D] gradients become one kernel each; the norm: 2 -> 1.
    assert twin["aten"] - fused["aten"] == 3 + 7 + 2
    assert fused["custom"] - twin["custom"] == 3
    assert sum(fused.values()) == sum(twin.values()) - 9
