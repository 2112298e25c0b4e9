"""k3.ops.short_conv_triton's kernels against an fp64 oracle and the PyTorch twin (k3.ops.short_conv_torch) on
outputs, dx and dweight: widths 1-4, lengths that do not fill a tile or are shorter than the taps, channels that
do not fill a block, a strided input (a column slice of a wider tensor), packed documents (boundaries inside
tiles and on their edges), tiles so short that the backward's W-1 extra rows cross one or more tile edges, the
planar parts (short_conv_triton_parts) with some parts' gradients unused; then the K3_CONV_BACKEND switch of
k3.ops.short_conv and KDA's joined conv through it. On CPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1): shapes are small so that the file takes seconds there."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from k3.ops.short_conv import short_conv, short_conv_parts, short_conv_torch  # noqa: E402
from k3.ops.short_conv_triton import ConvBlocks, short_conv_triton, short_conv_triton_parts  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Tiles of 8 times and 16 channels, 4 rows a step: the shapes below span several tiles in both directions.
SMALL = ConvBlocks(block_t=8, block_c=16, rows=4, num_warps=1)


def oracle(x, weight_CW, position_in_doc=None):
    """y_t = silu(sum_j w[:, W-1-j] x_{t-j}) in fp64 as a loop over taps, tap j counted where pos[t] >= j."""
    x64, w64 = x.double(), weight_CW.double()
    length, width = x.shape[1], w64.shape[1]
    pre = torch.zeros_like(x64)
    for j in range(width):
        shifted = F.pad(x64, (0, 0, j, 0))[:, :length]
        if position_in_doc is not None:
            shifted = shifted * (position_in_doc >= j).double().view(1, length, 1)
        pre = pre + shifted * w64[:, width - 1 - j]
    return F.silu(pre)


def with_grads(fn, x, weight_CW, dy):
    """(y, dx, dweight) of fn(x, weight) against the upstream gradient dy."""
    x = x.detach().clone().requires_grad_(True)
    w = weight_CW.detach().clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def inputs(batch, length, channels, width, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, channels, generator=g).to(DEVICE, dtype)
    w = (torch.randn(channels, width, generator=g) * 0.5).to(DEVICE, dtype)
    dy = torch.randn(batch, length, channels, generator=g).to(DEVICE, dtype)
    return x, w, dy


def assert_close_to(actual, expected, tol, names=("y", "dx", "dweight")):
    for name, a, e in zip(names, actual, expected):
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)}, want {tuple(e.shape)}"
        a, e = a.detach().double(), e.detach().double()
        error = float((a - e).abs().max() / e.abs().max().clamp_min(1.0))
        assert error <= tol, f"{name}: relative error {error:.3g} > {tol}"


def check(x, w, dy, blocks=SMALL, position_in_doc=None, cu_seqlens=None, tol=1e-5):
    """The kernels equal the fp64 oracle and, fp32 in, the twin (same packing) on y, dx and dweight."""
    fast = with_grads(lambda a, b: short_conv_triton(a, b, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc,
                                                     blocks=blocks, backward_blocks=blocks), x, w, dy)
    positions = position_in_doc if position_in_doc is not None else cu_positions(cu_seqlens, x.shape[1])
    assert_close_to(fast, with_grads(lambda a, b: oracle(a, b, positions), x, w, dy.double()), tol)
    if x.dtype == torch.float32:
        twin = with_grads(lambda a, b: short_conv_torch(a, b, None, positions)[0], x, w, dy)
        assert_close_to(fast, twin, tol)
    assert fast[0].is_contiguous() and fast[0].dtype == x.dtype and fast[1].dtype == x.dtype
    return fast


def cu_positions(cu_seqlens, length):
    if cu_seqlens is None:
        return None
    starts = cu_seqlens[:-1].repeat_interleave(cu_seqlens.diff())
    return torch.arange(length, device=cu_seqlens.device) - starts


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_each_width_matches_the_oracle_over_ragged_tiles(width):
    """T = 21 ends inside the third tile of 8; C = 20 fills one block of 16 and 4 of the next."""
    check(*inputs(2, 21, 20, width, seed=width))


@pytest.mark.parametrize("length", [1, 2, 3])
def test_inputs_shorter_than_the_taps(length):
    check(*inputs(2, length, 20, 4, seed=10 + length))


@pytest.mark.parametrize("blocks", [ConvBlocks(block_t=4, block_c=16, rows=4), ConvBlocks(block_t=2, block_c=16,
                                                                                          rows=1)])
def test_backward_rows_that_spill_into_the_next_tiles(blocks):
    """dx of a tile's last W-1 = 3 times waits for dpre of the next tile's first 3: with tiles of 4 the spill
    crosses one edge, with tiles of 2 (fewer times than the spill) it reaches two tiles on."""
    check(*inputs(1, 13, 16, 4, seed=20), blocks=blocks)


def test_strided_input_is_read_in_place():
    x, w, dy = inputs(2, 19, 24, 4, seed=3)
    wide = torch.randn(2, 19, 24 * 3, device=DEVICE)
    wide[:, :, 24:48] = x
    view = wide[:, :, 24:48]
    assert not view.is_contiguous()
    y_view = check(view, w, dy)[0]
    assert torch.equal(y_view, short_conv_triton(x, w, blocks=SMALL))


@pytest.mark.parametrize("bounds", [[0, 5, 8, 16, 21], [0, 1, 2, 3, 21]])
def test_packed_documents_by_cu_seqlens_and_by_positions(bounds):
    """Starts inside a tile (5), on tile edges (8, 16) and one-token documents: no tap crosses a start."""
    x, w, dy = inputs(1, 21, 20, 4, seed=len(bounds))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    by_cu = check(x, w, dy, cu_seqlens=cu_seqlens)
    by_positions = check(x, w, dy, position_in_doc=cu_positions(cu_seqlens.long(), 21))
    for a, b in zip(by_cu, by_positions):
        assert torch.equal(a, b)


def test_bf16_is_no_worse_than_the_twin():
    """The kernels sum in fp32 and round once; the twin rounds in bf16 along the way."""
    x, w, dy = inputs(2, 21, 20, 4, seed=7, dtype=torch.bfloat16)
    fast = check(x, w, dy, tol=1e-2)
    exact = with_grads(lambda a, b: oracle(a, b), x, w, dy.double())
    twin = with_grads(lambda a, b: short_conv_torch(a, b)[0], x, w, dy)
    for name, f, e, t in zip(("y", "dx", "dweight"), fast, exact, twin):
        fast_error, twin_error = float((f.double() - e).abs().max()), float((t.double() - e).abs().max())
        assert fast_error <= max(twin_error, 1e-2), f"{name}: kernels {fast_error:.3g}, twin {twin_error:.3g}"


def test_default_blocks_match_the_oracle():
    check(*inputs(1, 70, 40, 4, seed=11), blocks=None)


def planar_run(x, w, dys, parts, **kwargs):
    """(parts' outputs, dx, dweight) with part p's output weighted by dys[p] (None: that output unused)."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    ys = short_conv_triton_parts(x, w, parts, blocks=SMALL, backward_blocks=SMALL, **kwargs)
    loss = sum((y * dy).sum() for y, dy in zip(ys, dys) if dy is not None)
    loss.backward()
    return ys, x.grad, w.grad


@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)])
def test_planar_parts_equal_the_twin_split(used):
    """Three contiguous parts, their gradients read where they lie; an unused part's gradient is None to the
    backward and counts as zeros."""
    x, w, dy = inputs(2, 19, 48, 4, seed=30)
    dys = [dy[..., 16 * p:16 * (p + 1)].contiguous() if p in used else None for p in range(3)]
    ys, dx, dw = planar_run(x, w, dys, 3)
    dy_joined = torch.cat([d if d is not None else torch.zeros_like(dy[..., :16]) for d in dys], dim=-1)
    y_twin, dx_twin, dw_twin = with_grads(lambda a, b: short_conv_torch(a, b)[0], x, w, dy_joined)
    assert all(y.is_contiguous() and y.shape == (2, 19, 16) for y in ys)
    assert_close_to([*ys, dx, dw], [*y_twin.split(16, dim=-1), dx_twin, dw_twin], 1e-5,
                    names=("q", "k", "v", "dx", "dweight"))


def test_planar_parts_of_a_strided_packed_input():
    """Parts from a column slice of a wider GEMM output, packed documents, gradients as strided views (read in
    place, with their own strides) and parts narrower than a channel block (12 of 16)."""
    x, w, dy = inputs(1, 21, 24, 3, seed=31)
    wide = torch.randn(1, 21, 40, device=DEVICE)
    wide[..., 8:32] = x
    cu_seqlens = torch.tensor([0, 8, 11, 21], device=DEVICE)
    wide_dy = torch.randn(1, 21, 30, device=DEVICE)
    wide_dy[..., 2:14], wide_dy[..., 16:28] = dy[..., :12], dy[..., 12:]
    dys = [wide_dy[..., 2:14], wide_dy[..., 16:28]]
    ys, dx, dw = planar_run(wide[..., 8:32], w, dys, 2, cu_seqlens=cu_seqlens)
    positions = cu_positions(cu_seqlens, 21)
    y_want, dx_want, dw_want = with_grads(lambda a, b: oracle(a, b, positions), x, w, dy.double())
    assert_close_to([*ys, dx, dw], [*y_want.split(12, dim=-1), dx_want, dw_want], 1e-5,
                    names=("part 0", "part 1", "dx", "dweight"))


def test_bad_inputs_say_what_is_wrong():
    x, w, _ = inputs(2, 8, 16, 4, seed=1)
    with pytest.raises(ValueError, match=r"\[B, T, C\]"):
        short_conv_triton(x[0], w)
    with pytest.raises(ValueError, match=r"weight_CW must be \[C, W\] = \[16, 1..8\]"):
        short_conv_triton(x, w[:8])
    with pytest.raises(ValueError, match=r"weight_CW must be \[C, W\]"):
        short_conv_triton(x, torch.randn(16, 9, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous channels"):
        short_conv_triton(x.transpose(1, 2), torch.randn(8, 4, device=DEVICE))
    with pytest.raises(ValueError, match="must be one of"):
        short_conv_triton(x.double(), w)
    with pytest.raises(ValueError, match="need B = 1"):
        short_conv_triton(x, w, cu_seqlens=torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match=r"position_in_doc must be \[T\] = \[8\]"):
        short_conv_triton(x[:1], w, position_in_doc=torch.zeros(7, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="rows must divide block_t"):
        short_conv_triton(x, w, blocks=ConvBlocks(block_t=8, block_c=16, rows=3))
    with pytest.raises(ValueError, match="power of two"):
        short_conv_triton(x, w, blocks=ConvBlocks(block_t=8, block_c=24, rows=4))
    with pytest.raises(ValueError, match=r"parts must be an int in 1..4 dividing"):
        short_conv_triton_parts(x, w, 3)
    with pytest.raises(ValueError, match=r"parts must be an int in 1..4 dividing"):
        short_conv_triton_parts(x, w, 8)


@pytest.fixture
def backend(monkeypatch):
    return lambda name: monkeypatch.setenv("K3_CONV_BACKEND", name)


@pytest.mark.parametrize("length", [13, 2])
def test_switch_triton_equals_torch_with_the_same_tail(backend, length):
    """Forced on the CPU (the interpreter) the kernels run and the tail comes as the twin's: the last W-1
    inputs, zeros in front when T < W-1."""
    x, w, dy = inputs(2, length, 24, 4, seed=5)
    results = {}
    for name in ("torch", "triton"):
        backend(name)
        results[name] = with_grads(lambda a, b: short_conv(a, b)[0], x, w, dy), short_conv(x, w)[1]
    assert_close_to(results["triton"][0], results["torch"][0], 1e-5)
    assert torch.equal(results["triton"][1], results["torch"][1])


def test_switch_refuses_bad_values_and_tails_under_triton(backend):
    x, w, _ = inputs(1, 4, 8, 4, seed=2)
    backend("cudnn")
    with pytest.raises(ValueError, match="K3_CONV_BACKEND='cudnn'; use auto, torch, fla or triton"):
        short_conv(x, w)
    backend("triton")
    with pytest.raises(ValueError, match="take no cached tail"):
        short_conv(x, w, tail=torch.zeros(1, 3, 8, device=DEVICE))
    backend("auto")  # a call with a tail under auto keeps the paths it had (the twin on CPU, fla on CUDA)
    y, tail = short_conv(x, w, tail=torch.zeros(1, 3, 8, device=DEVICE))
    torch.testing.assert_close(y, short_conv_torch(x, w)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(tail, x[:, 1:])


@pytest.mark.parametrize("planar", [False, True])
def test_short_conv_parts_under_each_backend(backend, planar):
    """Triton's parts come contiguous whatever `planar` says; the twin's are column slices unless planar."""
    x, w, _ = inputs(2, 11, 48, 4, seed=6)
    want_y, want_tail = short_conv_torch(x, w)
    for name in ("torch", "triton"):
        backend(name)
        parts, tail = short_conv_parts(x, w, 3, planar=planar)
        assert torch.equal(tail, want_tail)
        assert all(p.is_contiguous() == (planar or name == "triton") for p in parts)
        torch.testing.assert_close(torch.cat(parts, dim=-1), want_y, rtol=1e-5, atol=1e-5)


def test_kda_layer_training_step_under_triton_equals_torch(backend):
    """KDA's joined q/k/v conv in training (no cache): planar parts from the kernels, gradients back without a
    cat, the same layer output and parameter gradients as the twin's path. The scan is KDA's PyTorch twin in both
    runs: the conv is what differs, and on a GPU fla's fp32 chunk_kda took minutes to compile (tests/ops/
    test_kda_layer_ops.py runs it)."""
    from k3 import ModelConfig, kernels
    from k3.layers.kda import KimiDeltaAttention

    config = ModelConfig.from_preset("debug", hidden_size=64, kda_num_heads=2, kda_head_dim=16)
    layer = KimiDeltaAttention(config, 0).to(DEVICE)
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    results = {}
    for name in ("torch", "triton"):
        backend(name)
        xg = x.clone().requires_grad_(True)
        with kernels.use(kda="torch"):
            y = layer(xg)
            grads = torch.autograd.grad((y * torch.linspace(-1, 1, 64, device=DEVICE)).sum(),
                                        [xg, *layer.parameters()], allow_unused=True)
        results[name] = [y, *(g for g in grads if g is not None)]
    assert len(results["torch"]) == len(results["triton"])
    # On CUDA the GPU's exp and the kernels' summation order differ from the twin's in the last bits, which the
    # scan's chunked solve amplifies; 5e-3 (test_kda_layer_ops's layer bound) still fails a wrong tap or gradient.
    tol = 1e-5 if DEVICE == "cpu" else 5e-3
    for a, b in zip(results["triton"], results["torch"]):
        error = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        assert error < tol
