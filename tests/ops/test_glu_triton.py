"""k3's GLU Triton kernels (k3.ops.glu_triton) against an fp64 oracle and the PyTorch twin (k3.ops.glu.glu_formula):
the output and both gradients under random upstream gradients, SiTU and SiLU, ragged tiles, the strided halves of a
fused gate/up output, values far out on the caps; the K3_GLU_BACKEND switch; and the debug model's loss and every
gradient with the kernels on and off.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from k3 import K3ForCausalLM, ModelConfig  # noqa: E402
from k3.ops import glu  # noqa: E402
from k3.ops.glu import glu_activation, glu_formula, glu_path  # noqa: E402
from k3.ops import glu_triton as launcher  # noqa: E402
from k3.ops.glu_triton import Blocks, glu_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Two rows and 32 columns a tile: several tiles along both dims, the last ones ragged (37 rows, 48 columns).
SMALL_TILES = Blocks(block_n=2, block_d=32, num_warps=4)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(shape, dtype, scale=6.0, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * scale).to(device, dtype).requires_grad_()
    up = (torch.randn(shape, generator=g) * scale * 8).to(device, dtype).requires_grad_()  # reaches up's cap of 25
    upstream = torch.randn(shape, generator=g).to(device, dtype)
    return gate, up, upstream


def _run(fn, gate, up, upstream, kind, **kwargs):
    h = fn(gate, up, kind, 4.0, 25.0, **kwargs)
    return [h, *torch.autograd.grad(h, [gate, up], upstream.to(h.dtype))]


def _oracle(gate, up, upstream, kind, beta_gate=4.0, beta_up=25.0):
    """[h, dgate, dup] in fp64 from the derivatives written out, with sech^2 = 1 / cosh^2 and s(1 - s) =
    s(g) s(-g): autograd through glu_formula would take 1 - tanh^2, which is 0 in fp64 once tanh rounds to 1
    (g/4 beyond ~19), where the true derivative is still ~1e-18 and an fp32 kernel can represent it."""
    g, u, dh = gate.detach().double(), up.detach().double(), upstream.double()
    s, s_neg = torch.sigmoid(g), torch.sigmoid(-g)
    if kind == "silu":
        a, da, b, db = g * s, s * (1 + g * s_neg), u, torch.ones_like(u)
    else:
        a = beta_gate * torch.tanh(g / beta_gate) * s
        da = s / torch.cosh(g / beta_gate) ** 2 + beta_gate * torch.tanh(g / beta_gate) * s * s_neg
        b, db = beta_up * torch.tanh(u / beta_up), 1 / torch.cosh(u / beta_up) ** 2
    return [a * b, dh * b * da, dh * a * db]


@pytest.mark.parametrize("kind", ["situ", "silu"])
def test_the_oracle_equals_autograd_through_the_formula_in_fp64(kind):
    gate, up, upstream = _inputs((37, 48), torch.float64, seed=9)
    for name, o, t in zip(["h", "dgate", "dup"], _oracle(gate, up, upstream, kind),
                          _run(glu_formula, gate, up, upstream, kind)):
        assert _rel(o, t) < 1e-12, name


@pytest.mark.parametrize("kind", ["situ", "silu"])
@pytest.mark.parametrize("blocks", [SMALL_TILES, None], ids=["small-tiles", "default"])
def test_fp32_kernels_equal_the_oracle(kind, blocks):
    gate, up, upstream = _inputs((37, 48), torch.float32, seed=1)
    got = _run(glu_triton, gate, up, upstream, kind, blocks=blocks, backward_blocks=blocks)
    for name, a, o in zip(["h", "dgate", "dup"], got, _oracle(gate, up, upstream, kind)):
        assert _rel(a, o) < 2e-6, name


def test_other_betas_take_the_general_exponentials():
    """beta_g = 4 shares one exponential between tanh and the sigmoid; any other beta computes both."""
    gate, up, upstream = _inputs((21, 40), torch.float32, seed=8)
    h = glu_triton(gate, up, "situ", 3.0, 10.0, SMALL_TILES, SMALL_TILES)
    got = [h, *torch.autograd.grad(h, [gate, up], upstream)]
    for name, a, o in zip(["h", "dgate", "dup"], got, _oracle(gate, up, upstream, "situ", 3.0, 10.0)):
        assert _rel(a, o) < 2e-6, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["situ", "silu"])
def test_half_precision_kernels_are_as_close_to_the_oracle_as_the_twin(kind, dtype):
    """In bf16 / fp16 the kernels compute in fp32 and round once; the twin rounds after every op. Each output is
    held to the twin's own error against fp64 (and to the format's precision)."""
    gate, up, upstream = _inputs((64, 96), dtype, seed=2)
    got = _run(glu_triton, gate, up, upstream, kind, blocks=SMALL_TILES, backward_blocks=SMALL_TILES)
    twin = _run(glu_formula, gate, up, upstream, kind)
    for name, a, t, o in zip(["h", "dgate", "dup"], got, twin, _oracle(gate, up, upstream, kind)):
        assert a.dtype == dtype, name
        assert _rel(a, o) <= max(_rel(t, o), 4e-3), name


@pytest.mark.parametrize("kind", ["situ", "silu"])
def test_values_far_out_on_the_caps_stay_finite_and_exact(kind):
    """|g| up to 1e4 (exp(-|g|) underflows to 0, exp(+|g|) would overflow) and |u| up to 1e4: sigmoid, tanh and
    1 - tanh^2 from exp(-|x|) keep every value finite and equal to fp64, the derivative's small tails included.
    On a GPU exp(-y) for y ~ 150 carries the rounding of y * log2(e) in fp32 (~1e-5 relative), and its
    approximate reciprocal ~1 ulp: the tolerance there is 3e-5."""
    values = torch.tensor([-1e4, -300.0, -90.0, -30.0, -8.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 8.0, 30.0, 90.0, 300.0, 1e4])
    gate = values.repeat_interleave(len(values)).view(len(values), len(values)).to(DEVICE).requires_grad_()
    up = values.repeat(len(values)).view(len(values), len(values)).to(DEVICE).requires_grad_()
    upstream = torch.ones_like(gate)
    got = _run(glu_triton, gate, up, upstream, kind, blocks=SMALL_TILES, backward_blocks=SMALL_TILES)
    for name, a, o in zip(["h", "dgate", "dup"], got, _oracle(gate, up, upstream, kind)):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), o, rtol=2e-6 if DEVICE == "cpu" else 3e-5, atol=1e-30, msg=name)


def test_strided_halves_and_three_d_inputs():
    """gate and up as the two halves of one [B, T, 2F] output (rows 2F apart, read in place) give the same result
    and gradients as contiguous copies; the result has the inputs' shape."""
    g = torch.Generator().manual_seed(3)
    both = (torch.randn(2, 9, 2 * 40, generator=g) * 6).to(DEVICE).requires_grad_()
    upstream = torch.randn(2, 9, 40, generator=g).to(DEVICE)
    gate, up = both.chunk(2, dim=-1)
    h = glu_triton(gate, up, "situ", blocks=SMALL_TILES, backward_blocks=SMALL_TILES)
    (grad,) = torch.autograd.grad(h, both, upstream)
    reference = glu_formula(gate, up, "situ")
    (ref_grad,) = torch.autograd.grad(reference, both, upstream)
    assert h.shape == (2, 9, 40)
    assert _rel(h, reference) < 2e-6 and _rel(grad, ref_grad) < 2e-6


def test_gradient_of_one_input_only_and_no_grad():
    gate, up, upstream = _inputs((5, 16), torch.float32, seed=4)
    up_frozen = up.detach()
    h = glu_triton(gate, up_frozen, "situ")
    (dgate,) = torch.autograd.grad(h, gate, upstream)
    (ref,) = torch.autograd.grad(glu_formula(gate, up_frozen, "situ"), gate, upstream)
    assert _rel(dgate, ref) < 2e-6
    with torch.no_grad():
        out = glu_triton(gate, up, "silu")
    assert not out.requires_grad and _rel(out, glu_formula(gate, up, "silu")) < 2e-6


def test_no_rows():
    gate, up, upstream = _inputs((0, 16), torch.float32)
    h, dgate, dup = _run(glu_triton, gate, up, upstream, "situ")
    assert h.shape == dgate.shape == dup.shape == (0, 16)


def test_rejects_what_it_cannot_compute():
    gate = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="must have one shape"):
        glu_triton(gate, torch.randn(4, 9, device=DEVICE), "situ")
    with pytest.raises(ValueError, match="one dtype of"):
        glu_triton(gate, gate.double(), "situ")
    with pytest.raises(ValueError, match="use 'silu' or 'situ'"):
        glu_triton(gate, gate, "gelu")


def test_switch_picks_the_path(monkeypatch):
    gate, up, _ = _inputs((4, 16), torch.float32, device="cpu")
    monkeypatch.delenv("K3_GLU_BACKEND", raising=False)
    assert glu_path(gate, up) == "formula"  # auto: CPU tensors keep the twin, bit for bit
    assert torch.equal(glu_activation(gate, up, "situ"), glu_formula(gate, up, "situ"))
    for value, path in [("torch", "formula"), ("compiled", "compiled"), ("triton", "triton"), (" Triton ", "triton")]:
        monkeypatch.setenv("K3_GLU_BACKEND", value)
        assert glu_path(gate, up) == path, value
    monkeypatch.setenv("K3_GLU_BACKEND", "compiled")
    with torch.no_grad():
        assert glu_path(gate, up) == "formula"  # compiled is for training calls
    monkeypatch.setenv("K3_GLU_BACKEND", "liger")
    with pytest.raises(ValueError, match="K3_GLU_BACKEND='liger'; use auto, torch, compiled or triton"):
        glu_path(gate, up)


def test_forced_triton_runs_the_kernels_through_glu_activation(monkeypatch):
    calls = []
    real = launcher.glu_forward

    def counting(gate_NF, *args, **kwargs):
        calls.append(tuple(gate_NF.shape))
        return real(gate_NF, *args, **kwargs)

    monkeypatch.setattr(launcher, "glu_forward", counting)
    monkeypatch.setenv("K3_GLU_BACKEND", "triton")
    gate, up, upstream = _inputs((3, 5, 16), torch.float32, seed=5)
    got = _run(glu_activation, gate, up, upstream, "situ")
    assert calls == [(15, 16)]
    for name, a, t in zip(["h", "dgate", "dup"], got, _run(glu_formula, gate, up, upstream, "situ")):
        assert _rel(a, t) < 2e-6, name


@pytest.mark.skipif(DEVICE != "cuda", reason="auto chooses the kernels for CUDA training calls only")
def test_auto_takes_the_kernels_for_cuda_training(monkeypatch):
    monkeypatch.delenv("K3_GLU_BACKEND", raising=False)
    gate, up, _ = _inputs((4, 16), torch.bfloat16)
    assert glu_path(gate, up) == "triton"
    assert glu_path(gate.detach(), up.detach()) == "formula"  # inference keeps the formula


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernels' approximate exp and reciprocal differ from the "
                    "twin by ~1e-7, enough to flip near-tied routing choices, which moves expert gradients by far more; "
                    "the kernel-level tests above hold the numerics there (and this one took 350 s of fla fp32 "
                    "compilation on one H200)")
def test_debug_model_loss_and_gradients_with_the_kernels(monkeypatch):
    """The debug model (SiTU in its dense, shared and routed GLUs) in fp32: the same loss and every parameter
    gradient with K3_GLU_BACKEND=triton as with the twin (Triton's interpreter computes the kernels' formulas in
    exact fp32 operations, so no routing choice flips)."""
    config = ModelConfig.from_preset("debug")
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3_GLU_BACKEND", backend)
        torch.manual_seed(0)
        model = K3ForCausalLM(config).to(DEVICE).train()
        ids = torch.randint(0, config.vocab_size, (2, 24), device=DEVICE)
        loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert config.hidden_act == "situ"
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert abs(float(loss_k - loss_t)) < 1e-5
    assert grads_k.keys() == grads_t.keys() and len(grads_t) > 10
    for name, grad in grads_t.items():
        assert _rel(grads_k[name], grad) < 1e-4, name
    assert glu.glu_backend() == "triton"
