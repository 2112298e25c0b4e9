"""k3's Triton short conv (k3.ops.short_conv_triton) against its PyTorch twin short_conv_torch: outputs, dx and
dweight, plain and planar ([P, B, T, C / P]), packed documents, a strided x, blocks ragged in time and channels;
then the K3_SHORT_CONV switch in k3.ops.short_conv and KDA's joined q|k|v conv. Without a GPU the kernels run in
Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the CUDA tests compile them.
"""

import os

import pytest
import torch

import k3.layers.kda as kda_layer
import k3.ops.short_conv as conv_ops
from k3 import ModelConfig
from k3.layers.kda import KimiDeltaAttention
from k3.ops.short_conv import short_conv, short_conv_torch
from k3.ops.short_conv_triton import short_conv_train
from k3.ops.triton_support import Blocks

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Small tiles so that test sizes span several time and channel blocks, ragged at the ends; the backward's two
# programs over time loop over two tiles each, the last one past the end.
BLOCKS = Blocks(block_n=16, block_d=32)
BACKWARD_BLOCKS = Blocks(block_n=16, block_d=32, programs=2)
DOCS = (1, 3, 7, 5, 21)  # packed documents in one row: 37 tokens, not a multiple of the block
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def positions(lengths, device="cpu") -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def case(batch, length, channels, taps, dtype, device="cpu", seed=0):
    """x as a column slice of a wider GEMM output (rows channels + 5 apart), weight [C, W], an upstream grad."""
    gen = torch.Generator(device).manual_seed(seed)
    wide = torch.randn(batch, length, channels + 5, generator=gen, device=device).to(dtype)
    weight = (torch.randn(channels, taps, generator=gen, device=device) / taps ** 0.5).to(dtype)
    return wide[..., 2:2 + channels], weight


def as_planes(y, planes):
    return y if planes == 1 else y.unflatten(-1, (planes, y.shape[-1] // planes)).movedim(-2, 0)


def twin(x, weight, position_in_doc, planes, dy):
    """short_conv_torch in fp32 on the same values: (y in the kernel's layout, dx, dweight)."""
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    y = as_planes(short_conv_torch(x32, w32, None, position_in_doc)[0], planes)
    return (y, *torch.autograd.grad(y, (x32, w32), dy.float()))


def kernel(x, weight, position_in_doc, planes, dy, blocks=BLOCKS, backward_blocks=BACKWARD_BLOCKS):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = short_conv_train(x, weight, position_in_doc, planes, blocks, backward_blocks)
    return (y, *torch.autograd.grad(y, (x, weight), dy))


def check_against_twin(x, weight, position_in_doc, planes, **blocks):
    gen = torch.Generator(x.device).manual_seed(1)
    dy = as_planes(torch.randn(x.shape, generator=gen, device=x.device), planes).to(x.dtype)
    got, want = kernel(x, weight, position_in_doc, planes, dy, **blocks), twin(x, weight, position_in_doc, planes, dy)
    y, dx, dw = got
    assert y.shape == want[0].shape and y.dtype == x.dtype and y.is_contiguous()
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.dtype == weight.dtype
    for name, a, b in zip(("y", "dx", "dweight"), got, want):
        torch.testing.assert_close(a.float(), b, **TOL[x.dtype], msg=lambda m: f"{name}: {m}")
    return got


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes", [1, 3])
@pytest.mark.parametrize("taps", [2, 3, 4])
def test_kernels_equal_the_twin(dtype, planes, taps):
    """Two rows of 37 tokens, 3 x 20 channels (planes of 20 in blocks of 32 columns), x a strided column slice."""
    x, weight = case(2, 37, 60, taps, dtype, seed=10 * taps + planes)
    assert x.stride(1) == 65
    check_against_twin(x, weight, None, planes)


@interpreted
@pytest.mark.parametrize("dtype, planes, taps", [(torch.float32, 3, 4), (torch.bfloat16, 1, 3),
                                                 (torch.float16, 3, 2)])
def test_packed_documents_equal_the_twin_and_a_loop_over_the_documents(dtype, planes, taps):
    """Documents of 1, 3, 7, 5 and 21 tokens in one row: no tap, forward or backward, crosses a boundary."""
    x, weight = case(1, sum(DOCS), 48, taps, dtype, seed=taps)
    y, dx, dw = check_against_twin(x, weight, positions(DOCS), planes)
    pieces = x.split(DOCS, dim=1)
    alone = [short_conv_train(piece, weight, None, planes, BLOCKS) for piece in pieces]
    torch.testing.assert_close(y, torch.cat(alone, dim=-2), **TOL[dtype])


@interpreted
def test_positions_in_int32_and_rows_above_one():
    """position_in_doc is per token, shared by every row (as the twin reads it), in int32 as well."""
    x, weight = case(2, 37, 40, 4, torch.float32, seed=5)
    check_against_twin(x, weight, positions(DOCS).int(), 1)


@interpreted
def test_default_blocks_and_no_grad():
    """The launch defaults (one block wider than the channels) and the forward alone outside autograd."""
    x, weight = case(1, 37, 96, 4, torch.float32, seed=6)
    check_against_twin(x, weight, positions(DOCS), 3, blocks=None, backward_blocks=None)
    with torch.no_grad():
        y = short_conv_train(x, weight, positions(DOCS), planes=3)
    want = as_planes(short_conv_torch(x, weight, None, positions(DOCS))[0], 3)
    torch.testing.assert_close(y, want, **TOL[torch.float32])


@interpreted
def test_one_token_and_one_tap():
    """T = 1 (every earlier tap masked) and W = 1 (no earlier taps at all)."""
    for length, taps in ((1, 4), (5, 1)):
        x, weight = case(2, length, 24, taps, torch.float32, seed=length)
        check_against_twin(x, weight, None, 3)


def test_bad_inputs_say_what_fits():
    x, weight = case(1, 5, 12, 4, torch.float32)
    with pytest.raises(ValueError, match="planes must divide"):
        short_conv_train(x, weight, planes=5)
    with pytest.raises(ValueError, match=r"weight_CW must be \[C, W\] = \[12, W\]"):
        short_conv_train(x, weight[:6])
    with pytest.raises(ValueError, match=r"position_in_doc must be \[T\] = \[5\]"):
        short_conv_train(x, weight, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="x must be"):
        short_conv_train(x.double(), weight)


# The K3_SHORT_CONV switch.

def spy_on_the_kernel(monkeypatch) -> list:
    calls, original = [], conv_ops.short_conv_train

    def spy(x, weight_CW, position_in_doc=None, planes=1, *args):
        calls.append(planes)
        return original(x, weight_CW, position_in_doc, planes, *args)

    monkeypatch.setattr(conv_ops, "short_conv_train", spy)
    return calls


@interpreted
@pytest.mark.parametrize("planes", [1, 3])
def test_switch_routes_short_conv_to_the_kernel_with_the_same_results(monkeypatch, planes):
    """With K3_SHORT_CONV=triton short_conv takes the kernel for calls without a tail (positions from cu_seqlens
    too) and gives the twin's y, new tail and gradients; the twin stays the default on the CPU."""
    x, weight = case(1, sum(DOCS), 48, 4, torch.float32, seed=7)
    cu_seqlens = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()])
    calls = spy_on_the_kernel(monkeypatch)

    def run():
        xs, w = x.detach().requires_grad_(), weight.detach().requires_grad_()
        y, tail = short_conv(xs, w, cu_seqlens=cu_seqlens, planes=planes)
        return (y, tail, *torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), (xs, w)))

    default = run()
    assert calls == []
    monkeypatch.setenv("K3_SHORT_CONV", "triton")
    switched = run()
    assert calls == [planes]
    for a, b in zip(switched, default, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@interpreted
def test_switch_leaves_tails_and_the_torch_backend_alone(monkeypatch):
    x, weight = case(2, 6, 12, 4, torch.float32)
    calls = spy_on_the_kernel(monkeypatch)
    monkeypatch.setenv("K3_SHORT_CONV", "triton")
    short_conv(x, weight, torch.zeros(2, 3, 12))  # a cached tail: the kernel has none
    monkeypatch.setenv("K3_FUSED_BACKEND", "torch")
    short_conv(x, weight)  # the PyTorch twin everywhere
    assert calls == []
    monkeypatch.setenv("K3_SHORT_CONV", "fast")
    with pytest.raises(ValueError, match="K3_SHORT_CONV"):
        short_conv(x, weight)


def kda_layer_and_input(device="cpu", length=37):
    """A KDA layer of width 32 (q|k|v: 96 channels) and a packed row longer than the fused-projection threshold,
    so that q, k and v reach the conv joined, as a column slice of one GEMM output."""
    config = ModelConfig.from_preset("debug", hidden_size=64, kda_num_heads=2, kda_head_dim=16)
    layer = KimiDeltaAttention(config, 0).to(device)
    layer.reset_gate_parameters()
    assert length >= kda_layer.FUSED_PROJECTION_MIN_TOKENS
    x = torch.randn(1, length, 64, device=device, generator=torch.Generator(device).manual_seed(2))
    return layer, x


def layer_outputs_and_grads(layer, x, cu_seqlens=None, position_in_doc=None):
    x = x.detach().requires_grad_()
    y = layer(x, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc)
    loss = (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum()
    return [y, *torch.autograd.grad(loss, [x, *layer.parameters()])]


@interpreted
def test_kda_layer_through_the_kernel_equals_the_default_path(monkeypatch):
    """K3_SHORT_CONV=triton inside the KDA layer (packed documents): one planar conv over q|k|v, and the layer's
    output and every gradient as on the default path."""
    layer, x = kda_layer_and_input()
    packed = dict(cu_seqlens=torch.tensor([0, 1, 4, 11, 16, 37]), position_in_doc=positions(DOCS))
    calls = spy_on_the_kernel(monkeypatch)
    default = layer_outputs_and_grads(layer, x, **packed)
    monkeypatch.setenv("K3_SHORT_CONV", "triton")
    switched = layer_outputs_and_grads(layer, x, **packed)
    assert calls == [3]
    for a, b in zip(switched, default, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@interpreted
def test_joined_conv_returns_contiguous_planes_equal_to_the_column_slices(monkeypatch):
    """_convolve with the kernel selected: q, k, v as three contiguous tensors that are one [3, B, T, width]
    block, equal to the default path's column slices; the new tails as the default path's."""
    layer, x = kda_layer_and_input()
    qkv = layer._project(x)[0]
    assert isinstance(qkv, torch.Tensor) and not qkv.is_contiguous()
    with torch.no_grad():
        (q, k, v), tails = layer._convolve(qkv, (None, None, None), None, None)
        monkeypatch.setenv("K3_SHORT_CONV", "triton")
        (pq, pk, pv), planar_tails = layer._convolve(qkv, (None, None, None), None, None)
    assert not q.is_contiguous() and all(t.is_contiguous() for t in (pq, pk, pv))
    assert pk.data_ptr() == pq.data_ptr() + pq.numel() * pq.element_size()  # one block, plane after plane
    for a, b in zip((pq, pk, pv, *planar_tails), (q, k, v, *tails), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# On a GPU (someone runs these on an H200): the compiled kernels.

@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes", [1, 3])
def test_cuda_kernels_equal_the_twin(dtype, planes):
    x, weight = case(2, 37, 60, 4, dtype, device="cuda", seed=planes)
    check_against_twin(x, weight, None, planes)
    x, weight = case(1, sum(DOCS), 48, 3, dtype, device="cuda", seed=planes)
    check_against_twin(x, weight, positions(DOCS, "cuda"), planes)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_larger_shape_with_default_blocks(packed):
    """2 rows of 1000 tokens, q|k|v of 256 channels each, bf16, K3's 4 taps, through the launch defaults."""
    x, weight = case(2, 1000, 3 * 256, 4, torch.bfloat16, device="cuda", seed=3)
    pos = positions((1, 3, 7, 5, 984), "cuda") if packed else None
    check_against_twin(x, weight, pos, 3, blocks=None, backward_blocks=None)


@needs_cuda
@pytest.mark.cuda
def test_cuda_kda_layer_through_the_kernel_equals_the_default_path(monkeypatch):
    layer, x = kda_layer_and_input("cuda", length=300)
    default = layer_outputs_and_grads(layer, x)
    monkeypatch.setenv("K3_SHORT_CONV", "triton")
    calls = spy_on_the_kernel(monkeypatch)
    switched = layer_outputs_and_grads(layer, x)
    assert calls == [3]
    for a, b in zip(switched, default, strict=True):  # fla's conv or the twin's against the kernel, in fp32
        assert ((a - b).double().norm() / b.double().norm().clamp_min(1e-30)).item() < 1e-4
