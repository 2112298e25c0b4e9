"""The k3:: custom ops that carry fla's kernels through torch.compile (k3.ops.kda, norm, short_conv), checked on
CPU with PyTorch stand-ins for fla (tests/ops/fla_standins.py): torch.library.opcheck holds each op's fake
(shapes, strides, dtypes) to its real output, and a Triton compile failure inside an op still falls back to the
PyTorch twin under torch.compile. Eager calls never take the ops."""

import pytest
import torch

import k3.ops.fused_backend as fused_backend
from k3.ops.kda import chunk_kda, fused_recurrent_kda
from k3.ops.norm import rms_norm, rms_norm_gated, rms_norm_gated_torch, rms_norm_torch
from k3.ops.short_conv import short_conv, short_conv_torch
from tests.ops import fla_standins


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(fused_backend, "_failed", {})
    with fla_standins.installed(monkeypatch):
        yield


def kda_inputs(batch=2, length=3, heads=2, dim=8):
    q, k, v, g = (torch.randn(batch, length, heads, dim) for _ in range(4))
    beta = torch.randn(batch, length, heads)
    state = torch.randn(batch, heads, dim, dim)
    gate = dict(use_gate_in_kernel=True, A_log=torch.randn(heads), dt_bias=torch.randn(heads * dim),
                use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    return q, k, v, g, beta, state, gate


@pytest.mark.parametrize("name", ["fla_chunk_kda", "fla_fused_recurrent_kda"])
@pytest.mark.parametrize("final", [True, False])
def test_kda_ops_fakes_match_the_kernels(standins, name, final):
    q, k, v, g, beta, state, gate = kda_inputs()
    op = getattr(torch.ops.k3, name).default
    args = (q, k, v, g, beta, None, state, final, True, True, gate["A_log"], gate["dt_bias"], True, -5.0, True, None)
    torch.library.opcheck(op, args)
    o, ht = op(*args)
    assert o.shape == v.shape and ht.dtype == torch.float32
    assert ht.shape == ((2, 2, 8, 8) if final else (0,))


def test_conv_and_norm_ops_fakes_match_the_kernels(standins):
    x, w = torch.randn(2, 3, 16), torch.randn(16, 4)
    for state in (None, torch.randn(2, 16, 4)):
        torch.library.opcheck(torch.ops.k3.fla_causal_conv1d.default, (x, w, state))
    torch.library.opcheck(torch.ops.k3.fla_rms_norm.default, (x, torch.randn(16), 1e-5))
    torch.library.opcheck(torch.ops.k3.fla_rms_norm_gated.default, (x, torch.randn(2, 3, 16), torch.randn(16), 1e-5))


def test_compiled_calls_take_the_ops_and_equal_eager(standins):
    """Under torch.compile (no grad) each dispatch lowers to its op, in one graph; results equal the eager calls."""
    q, k, v, g, beta, state, gate = kda_inputs(length=1)
    # Two conv tokens: a one-token step with a tail is plain math under compile (short_conv_step), not the op.
    x, w, tail = torch.randn(2, 2, 16), torch.randn(16, 4), torch.randn(2, 3, 16)
    norm_w, norm_g = torch.randn(16), torch.randn(2, 2, 16)

    def step(q, k, v, g, beta, state, x, w, tail):
        o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, **gate)
        o2, _ = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=False, **gate)
        y, new_tail = short_conv(x, w, tail)
        return o, ht, o2, y, new_tail, rms_norm(y, norm_w, 1e-5), rms_norm_gated(y, norm_g, norm_w, 1e-5)

    args = (q, k, v, g, beta, state, x, w, tail)
    with torch.no_grad():
        explained = torch._dynamo.explain(step)(*args)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
        expected = step(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    targets = [str(n.target) for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"]
    for name in ("fla_fused_recurrent_kda", "fla_chunk_kda", "fla_causal_conv1d", "fla_rms_norm",
                 "fla_rms_norm_gated"):
        assert f"k3.{name}.default" in targets, (name, targets)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_training_and_eager_never_take_the_ops(standins, monkeypatch):
    import k3.ops.short_conv as conv_ops

    monkeypatch.setattr(conv_ops, "fla_causal_conv1d_op", lambda *a: pytest.fail("eager call took the op"))
    x, w = torch.randn(2, 5, 16), torch.randn(16, 4)
    with torch.no_grad():
        short_conv(x, w)
    assert not fused_backend.opaque_under_compile(x)
    w.requires_grad_(True)

    def loss(x, w):
        return short_conv(x, w)[0].sum()

    # With autograd under compile the op (which has no backward) is not taken either: gradients flow.
    grad = torch.autograd.grad(torch.compile(loss, backend="aot_eager")(x, w), w)[0]
    expected = torch.autograd.grad(short_conv_torch(x, w)[0].sum(), w)[0]
    torch.testing.assert_close(grad, expected)


def test_triton_compile_failure_inside_an_op_falls_back_under_compile(standins, monkeypatch):
    import k3.ops.norm as norm_ops

    class CompilationError(Exception):  # Triton's name; is_triton_compile_failure goes by it
        pass

    def broken(*args, **kwargs):
        raise CompilationError("PassManager::run failed")

    monkeypatch.setattr(norm_ops, "_load_fla_norms", lambda: (broken, broken))
    x, gate, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    both = lambda x, gate, w: (rms_norm(x, w, 1e-5), rms_norm_gated(x, gate, w, 1e-5))  # noqa: E731
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="failed to compile"):
        y, z = torch.compile(both, fullgraph=True, backend="aot_eager")(x, gate, w)
    torch.testing.assert_close(y, rms_norm_torch(x, w, 1e-5))
    torch.testing.assert_close(z, rms_norm_gated_torch(x, gate, w, 1e-5))
    assert {v[0] for v in fused_backend._failed} == {"rms_norm", "rms_norm_gated"}
