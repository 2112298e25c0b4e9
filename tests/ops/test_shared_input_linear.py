"""k3.ops.shared_input_linear against one F.linear per weight: outputs, dx and every weight's gradient, in fp32
(the joined forward and the accumulating dgrad chain reorder no sums within an element's dot product, but the
GEMMs' blocking may differ, so the comparison allows fp32 rounding), and in a MoE layer and a GLU MLP against
K3_JOIN_PROJECTIONS=0 (a MoE layer, a GLU MLP and MLA's input projections)."""

import pytest
import torch

from k3.ops.shared_input_linear import linears_of_one_input, linears_of_one_input_twin


def _case(widths, shape=(2, 7, 24), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    weights = [(torch.randn(w, shape[-1], generator=g, dtype=dtype) / 5).requires_grad_() for w in widths]
    upstream = [torch.randn(*shape[:-1], w, generator=g, dtype=dtype) for w in widths]
    return x, weights, upstream


@pytest.mark.parametrize("widths", [[16], [16, 8, 8], [5, 33, 12, 3]])
def test_outputs_and_gradients_match_one_linear_per_weight(widths):
    x, weights, upstream = _case(widths)
    got = linears_of_one_input(x, weights)
    want = linears_of_one_input_twin(x, weights)
    assert [tuple(y.shape) for y in got] == [tuple(y.shape) for y in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    grads_got = torch.autograd.grad(got, [x, *weights], upstream)
    grads_want = torch.autograd.grad(want, [x, *weights], upstream)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_output_no_loss_reaches_and_a_frozen_weight():
    x, weights, upstream = _case([8, 6, 4])
    weights[1].requires_grad_(False)
    a, _, c = linears_of_one_input(x, weights)
    loss = (a * upstream[0]).sum() + (c * upstream[2]).sum()
    dx, dw0, dw2 = torch.autograd.grad(loss, [x, weights[0], weights[2]])
    a2, _, c2 = linears_of_one_input_twin(x, weights)
    loss2 = (a2 * upstream[0]).sum() + (c2 * upstream[2]).sum()
    for got, want in zip((dx, dw0, dw2), torch.autograd.grad(loss2, [x, weights[0], weights[2]])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_weights_are_named():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight 1 is \(4, 6\)"):
        linears_of_one_input(x, [torch.randn(4, 8), torch.randn(4, 6)])
    with pytest.raises(ValueError, match="weight 0 .*bfloat16"):
        linears_of_one_input(x, [torch.randn(4, 8, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one"):
        linears_of_one_input(x, [])


def _layer_input_and_joined_calls(monkeypatch, preset_layer, record):
    """A debug-preset layer with weights large enough to matter, an input of 32 tokens, and the list that
    record(args) appends to on each call of the joined projections' autograd function."""
    import k3.ops.shared_input_linear as joined
    from k3.config import ModelConfig
    from k3.layers.mlp import GLUMLP
    from k3.layers.mla import GatedMLA
    from k3.layers.moe import LatentMoE

    config = ModelConfig.from_preset("debug")
    torch.manual_seed(0)
    layer = {"moe": lambda: LatentMoE(config), "mlp": lambda: GLUMLP(config, config.hidden_size, 48),
             "mla": lambda: GatedMLA(config, 1)}[preset_layer]()
    for p in layer.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(1)).requires_grad_()
    calls = []
    monkeypatch.setattr(joined._SharedInputLinear, "apply",
                        staticmethod(lambda *a, _f=joined._SharedInputLinear.apply: calls.append(record(a)) or _f(*a)))
    return layer, x, calls


@pytest.mark.parametrize("preset_layer", ["moe", "mlp", "mla"])
def test_layers_train_the_same_with_joined_projections(monkeypatch, preset_layer):
    layer, x, calls = _layer_input_and_joined_calls(monkeypatch, preset_layer, lambda args: 1)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("K3_JOIN_PROJECTIONS", flag)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results[flag] = (out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()
                                                       if p.grad is not None})
        if flag == "1":
            assert calls == [1]  # the joined path ran
    assert calls == [1]  # and the switch turned it off
    out1, dx1, g1 = results["1"]
    out0, dx0, g0 = results["0"]
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)


def test_decode_sized_inputs_and_no_grad_keep_one_gemm_per_projection_and_autocast_admits_fp32_weights(monkeypatch):
    from k3.ops.shared_input_linear import joins_projections

    x = torch.randn(2, 16, 8)
    assert joins_projections(x)
    assert not joins_projections(x[:, :1])  # one decode token a row
    with torch.no_grad():
        assert not joins_projections(x)
    fp32 = torch.nn.Linear(8, 4, bias=False)
    assert not joins_projections(x.bfloat16(), (fp32,))  # weights in another dtype than x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert joins_projections(x.bfloat16(), (fp32,))  # autocast casts them, as F.linear's would be
    monkeypatch.setenv("K3_JOIN_PROJECTIONS", "0")
    assert not joins_projections(x)


@pytest.mark.parametrize("preset_layer", ["moe", "mlp", "mla"])
def test_layers_under_autocast_join_their_projections_like_autocast_runs_them(monkeypatch, preset_layer):
    """The trainer's CUDA default, bf16 autocast over fp32 weights, here on CPU: the joined path runs, its outputs
    and gradients are autocast's own within bf16 rounding, and the weights' gradients come back in fp32."""
    layer, x, calls = _layer_input_and_joined_calls(monkeypatch, preset_layer, lambda args: args[0].dtype)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("K3_JOIN_PROJECTIONS", flag)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results[flag] = (out.detach().float(), x.grad.clone(),
                         {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    assert calls == [torch.bfloat16]  # joined once, in autocast's dtype, and not with the switch off
    (out1, dx1, g1), (out0, dx0, g0) = results["1"], results["0"]

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    assert rel(out1, out0) < 1e-3 and rel(dx1, dx0) < 1e-2
    assert g1.keys() == g0.keys()
    for name in g0:
        assert g1[name].dtype == torch.float32, name
        assert rel(g1[name], g0[name]) < 1e-2, (name, rel(g1[name], g0[name]))
