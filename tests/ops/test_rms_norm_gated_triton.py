"""KDA's gated RMSNorm through k3's RMSNorm Triton kernels (k3.ops.rms_norm_triton with `gate`): the output and the
gradients of x, gate and weight against an fp64 oracle and the twin (k3.ops.norm.rms_norm_gated_torch), on both
kernel paths (whole row, rows in chunks); k3.ops.norm.rms_norm_gated's routing; a KDA layer with the kernels
against the twin. Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import k3.ops.norm as norm_ops  # noqa: E402
from k3.ops.norm import rms_norm_gated, rms_norm_gated_torch  # noqa: E402
from k3.ops.rms_norm_triton import Blocks, rms_norm_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
EPS = 1e-5
CHUNKED = Blocks(block_n=4, block_d=32, num_warps=4, programs=2)  # rows in several chunks, the last ragged


def whole_row(dim: int) -> Blocks:
    return Blocks(block_n=2, block_d=max(16, 1 << (dim - 1).bit_length()), num_warps=4, programs=3)


def oracle(x, gate, weight, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double() * torch.sigmoid(gate.double())


def kernels(blocks):
    return lambda x, gate, weight, eps: rms_norm_triton(x, weight, eps, blocks, blocks, gate=gate)


def _inputs(shape, dtype, gate_dtype, weight_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(DEVICE, dtype).requires_grad_()
    gate = (torch.randn(shape, generator=g) * 2).to(DEVICE, gate_dtype).requires_grad_()
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, weight_dtype).requires_grad_()
    upstream = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return x, gate, weight, upstream


def _run(fn, x, gate, weight, upstream):
    out = fn(x, gate, weight, EPS)
    return [out, *torch.autograd.grad(out, [x, gate, weight], upstream.to(out.dtype))]


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dim, rows, dtype, gate_dtype, weight_dtype", [
    (40, 33, torch.float32, torch.float32, torch.float32),
    (130, 7, torch.float32, torch.float32, torch.float32),
    (128, 9, torch.bfloat16, torch.bfloat16, torch.float32),   # KDA's: head_dim 128, bf16 o and gate
    (40, 7, torch.bfloat16, torch.float32, torch.bfloat16),
    (72, 5, torch.float16, torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("path", ["chunked", "whole_row", "default"])
def test_gated_kernels_equal_the_oracle_and_the_twin(dim, rows, dtype, gate_dtype, weight_dtype, path):
    blocks = {"chunked": CHUNKED, "whole_row": whole_row(dim), "default": None}[path]
    x, gate, weight, upstream = _inputs((rows, dim), dtype, gate_dtype, weight_dtype, seed=dim + rows)
    got = _run(kernels(blocks), x, gate, weight, upstream)
    twin = _run(rms_norm_gated_torch, x, gate, weight, upstream)
    want = _run(oracle, x, gate, weight, upstream)
    assert [t.dtype for t in got] == [dtype, dtype, gate_dtype, weight_dtype]
    low = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1e-2, 2e-3)}
    for name, a, t, o, kind in zip(["y", "dx", "dgate", "dweight"], got, twin, want,
                                   [dtype, dtype, gate_dtype, weight_dtype]):
        oracle_tol, twin_tol = low[kind] if dtype == torch.float32 else (max(low[kind][0], low[dtype][0]),
                                                                         max(low[kind][1], low[dtype][1]))
        assert torch.isfinite(a).all(), name
        assert _rel(a, o) < oracle_tol, f"{name}: {_rel(a, o):.2e} from the fp64 oracle"
        assert _rel(a, t) < twin_tol, f"{name}: {_rel(a, t):.2e} from the twin"


def test_no_grad_forward_equals_the_training_forward_and_the_gate_alone_gets_its_gradient():
    x, gate, weight, upstream = _inputs((3, 6, 48), torch.float32, torch.float32, seed=3)
    with torch.no_grad():
        plain = rms_norm_triton(x, weight, EPS, gate=gate)
    assert plain.grad_fn is None
    tracked = rms_norm_triton(x, weight, EPS, gate=gate)
    assert torch.equal(plain, tracked.detach())
    dgate = torch.autograd.grad(rms_norm_triton(x.detach(), weight.detach(), EPS, gate=gate), gate, upstream)[0]
    want = torch.autograd.grad(oracle(x, gate, weight, EPS), gate, upstream.double())[0]
    torch.testing.assert_close(dgate, want.float(), rtol=1e-5, atol=1e-6)


def test_a_strided_gate_view_gets_its_gradient_in_its_own_layout():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(6, 2, 40, generator=g).to(DEVICE).requires_grad_()
    gate = base.transpose(0, 1)  # rows not D apart: copied for the kernel
    x = torch.randn(2, 6, 40, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.rand(40, generator=g) + 0.5).to(DEVICE)
    upstream = torch.randn(2, 6, 40, generator=g).to(DEVICE)
    got = torch.autograd.grad(rms_norm_triton(x, weight, EPS, gate=gate), [x, base], upstream)
    want = torch.autograd.grad(oracle(x, gate, weight, EPS), [x, base], upstream.double())
    for a, w in zip(got, want):
        assert a.shape == w.shape
        torch.testing.assert_close(a, w.float(), rtol=1e-5, atol=1e-5)


def test_rejects_a_gate_that_does_not_match_x():
    x = torch.randn(3, 8, device=DEVICE)
    weight = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate is \(3, 9\); it must have x's shape \(3, 8\)"):
        rms_norm_triton(x, weight, EPS, gate=torch.randn(3, 9, device=DEVICE))
    with pytest.raises(ValueError, match="gate is torch.float64"):
        rms_norm_triton(x, weight, EPS, gate=torch.randn(3, 8, device=DEVICE, dtype=torch.float64))


def test_rms_norm_gated_takes_the_kernels_when_forced_and_the_twin_on_cpu_otherwise(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("gate") is not None)
        return rms_norm_triton(*args, **kwargs)

    monkeypatch.setattr(norm_ops, "rms_norm_triton", counted)
    x, gate, weight, upstream = _inputs((2, 5, 40), torch.float32, torch.float32, seed=5)
    monkeypatch.setenv("K3_RMS_NORM", "triton")
    got = _run(rms_norm_gated, x, gate, weight, upstream)
    assert calls == [True]
    for name, a, t in zip(["y", "dx", "dgate", "dweight"], got, _run(rms_norm_gated_torch, x, gate, weight, upstream)):
        assert _rel(a, t) < 1e-5, name
    with torch.no_grad():  # an fp64 gate is not the kernels': the other path takes it
        rms_norm_gated(x, gate.double(), weight, EPS)
    assert calls == [True]
    if DEVICE == "cpu":
        monkeypatch.delenv("K3_RMS_NORM")
        _run(rms_norm_gated, x, gate, weight, upstream)
        assert calls == [True]  # auto: CPU tensors keep the twin


def test_kda_layer_output_norm_through_the_kernels_equals_the_twin(monkeypatch):
    """The KDA layer's o_norm (head_dim rows, gate from the output-gate projection) with the kernels forced,
    against the same layer with the twin: outputs and every gradient, fp32. The scan is KDA's PyTorch twin in both
    runs (the norm is what differs; on a GPU fla's fp32 chunk_kda took minutes to compile)."""
    from k3 import kernels
    from k3.config import ModelConfig
    from k3.layers.kda import KimiDeltaAttention

    torch.manual_seed(0)
    config = ModelConfig(hidden_size=64, kda_num_heads=2, kda_head_dim=32, num_layers=1, full_attn_layers=[])
    layer = KimiDeltaAttention(config, 0).to(DEVICE)
    x = torch.randn(2, 24, 64, device=DEVICE, requires_grad=True)
    upstream = torch.randn(2, 24, 64, device=DEVICE)

    def run():
        with kernels.use(kda="torch"):
            out = layer(x)
            grads = torch.autograd.grad(out, [x, *layer.parameters()], upstream)
        return out, grads

    calls = []
    launch = norm_ops.rms_norm_triton
    monkeypatch.setattr(norm_ops, "rms_norm_triton", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setenv("K3_RMS_NORM", "triton")
    out, grads = run()
    assert calls, "the gated norm did not take the kernels"
    kernel_calls = len(calls)
    monkeypatch.setenv("K3_RMS_NORM", "torch")  # the twin on any device (k3_triton_path None would take fla on CUDA)
    twin_out, twin_grads = run()
    assert len(calls) == kernel_calls
    torch.testing.assert_close(out, twin_out, rtol=1e-5, atol=1e-5)
    for (name, _), a, t in zip([("x", None), *layer.named_parameters()], grads, twin_grads):
        torch.testing.assert_close(a, t, rtol=1e-4, atol=1e-5, msg=name)


def test_auto_takes_the_kernels_without_autograd_and_leaves_training_to_fla(monkeypatch):
    """Under auto ("chosen", as on CUDA) the gated norm takes k3's kernels for calls without autograd and the other
    path for training calls (fla's kernel on a GPU, here the twin), until the kernels are timed in training."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("gate") is not None)
        return rms_norm_triton(*args, **kwargs)

    monkeypatch.setattr(norm_ops, "rms_norm_triton", counted)
    monkeypatch.setattr(norm_ops, "k3_triton_path", lambda x, weight: "chosen")
    others = []
    other_path = norm_ops._rms_norm_gated_untriton
    monkeypatch.setattr(norm_ops, "_rms_norm_gated_untriton", lambda *a: others.append(1) or other_path(*a))
    x, gate, weight, upstream = _inputs((2, 5, 40), torch.float32, torch.float32, seed=6)
    with torch.no_grad():
        plain = rms_norm_gated(x, gate, weight, EPS)
    assert calls == [True] and not others
    trained = _run(rms_norm_gated, x, gate, weight, upstream)
    assert calls == [True] and others == [1]
    torch.testing.assert_close(plain, trained[0].detach(), rtol=1e-5, atol=1e-6)
    # On CPU the other path is the twin itself; on CUDA it is fla's fp32 kernel, a few fp32 roundings away.
    tolerance = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1e-5, atol=1e-5)
    for name, a, t in zip(["y", "dx", "dgate", "dweight"], trained,
                          _run(rms_norm_gated_torch, x, gate, weight, upstream)):
        torch.testing.assert_close(a, t, **tolerance, msg=name)
