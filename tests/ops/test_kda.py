"""KDA fast paths against the fp32 loop: outputs, final states and every gradient, per-tensor tolerances.

Shape legend: B batch, T time, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import k3.ops.kda as kda
from k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_recurrent_kda, set_kda_backend


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    """These tests hold the PyTorch paths to the oracle, whatever K3_KDA_BACKEND says outside."""
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    set_kda_backend(None)
    yield
    set_kda_backend(None)


def err_ratio(ref: torch.Tensor, got: torch.Tensor) -> float:
    """RMS of the difference relative to the RMS of the reference (fla's measure)."""
    ref, got = ref.detach().double(), got.detach().double()
    return ((ref - got).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    r = err_ratio(ref, got)
    assert r <= ratio, f"{name}: error ratio {r:.3g} > {ratio:.3g}"


def make_gate(raw: torch.Tensor, form: str) -> torch.Tensor:
    """Log decay [B, T, H, K] from a raw projection, with realistic parameters per gate form."""
    H, K = raw.shape[-2:]
    if form == "lower_bound":
        return kda_gate(raw, torch.zeros(H), torch.zeros(H * K), lower_bound=-5.0)
    # Kimi Linear initialisation: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt).
    A_log = torch.empty(H).uniform_(1, 16).log()
    dt = torch.exp(torch.rand(H * K) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    if form == "softplus_large":
        # Every other channel decays hard (about -25 per token, far beyond e^-88 across one 16-token sub-chunk),
        # the rest as initialised: the forgetting channels must not spoil the remembering ones.
        strong = torch.arange(H * K) % 2 == 0
        return kda_gate(raw, A_log.clamp_min(math.log(4.0)), torch.where(strong, 6.0, dt_bias))
    return kda_gate(raw, A_log, dt_bias)


def make_inputs(B, T, H, K, V, gate="lower_bound", with_h0=True, l2=False, dtype=torch.float32):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    if not l2:
        # The UT solve is well conditioned only for normalised keys, as in the model.
        k = F.normalize(k, p=2, dim=-1)
    v = torch.randn(B, T, H, V)
    g = make_gate(torch.randn(B, T, H, K), gate)
    beta = torch.rand(B, T, H).sigmoid()
    h0 = torch.randn(B, H, K, V) if with_h0 else None
    leaves = [x.to(dtype) for x in (q, k, v, g, beta)]
    leaves.append(h0)
    return [x.requires_grad_() if x is not None else None for x in leaves]


def run_with_grads(fn, q, k, v, g, beta, h0, l2, do, dht, **kw):
    for x in (q, k, v, g, beta, h0):
        if x is not None:
            x.grad = None
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, **kw)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad.clone() if x is not None else None for x in (q, k, v, g, beta, h0)]
    return o.detach(), ht.detach(), grads


# (B, T, H, K, V, gate, with_h0, l2): odd lengths, both gate forms, l2 on/off, with and without a state.
CASES = [
    (2, 1, 2, 16, 16, "lower_bound", True, False),
    (2, 63, 2, 32, 32, "softplus", False, True),
    (2, 65, 2, 32, 16, "lower_bound", True, True),
    (1, 200, 2, 32, 32, "softplus", True, False),
    (2, 200, 2, 16, 32, "lower_bound", False, False),
    (1, 130, 2, 64, 64, "lower_bound", True, True),
    (1, 100, 2, 64, 64, "softplus", True, True),
    (2, 150, 2, 32, 32, "softplus_large", True, True),
]
# Error-ratio tolerances per tensor, about 5x the worst seen over seeds (fp32 against fp32); dg sums the most
# terms (a reverse cumulative sum over each chunk), so it gets more room.
TOL = {"o": 5e-6, "ht": 5e-6, "dq": 5e-6, "dk": 5e-6, "dv": 5e-6, "dg": 2e-5, "dbeta": 5e-6, "dh0": 5e-6}


def _check_against_naive(fn, case):
    B, T, H, K, V, gate, with_h0, l2 = case
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, gate, with_h0, l2)
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    ref_o, ref_ht, ref_grads = run_with_grads(naive_recurrent_kda, q, k, v, g, beta, h0, l2, do, dht)
    o, ht, grads = run_with_grads(fn, q, k, v, g, beta, h0, l2, do, dht)
    assert_close("o", ref_o, o, TOL["o"])
    assert_close("ht", ref_ht, ht, TOL["ht"])
    for name, ref, got in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref_grads, grads):
        if ref is not None:
            assert_close(name, ref, got, TOL[name])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-K{c[3]}-V{c[4]}-{c[5]}-h0{int(c[6])}-l2{int(c[7])}")
def test_chunk_matches_naive(case):
    _check_against_naive(chunk_kda, case)


@pytest.mark.parametrize("case", CASES[:4] + CASES[-1:], ids=lambda c: f"B{c[0]}-T{c[1]}-{c[5]}-h0{int(c[6])}-l2{int(c[7])}")
def test_fused_recurrent_matches_naive(case):
    _check_against_naive(fused_recurrent_kda, case)


def test_large_gates_take_the_pairwise_path():
    """The softplus_large case must really decay beyond fp32's exp range inside a sub-chunk (else it tests nothing new)."""
    g = make_gate(torch.randn(1, 64, 2, 16), "softplus_large")
    sub_chunk_decay = -g.unflatten(1, (4, 16)).sum(2)
    assert sub_chunk_decay.max() > 2 * 44.0
    g = make_gate(torch.randn(1, 64, 2, 16), "lower_bound")
    assert g.min() > -5.0 and g.max() < 0.0


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda], ids=["chunk", "fused_recurrent"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_bf16_forward(fn, gate):
    B, T, H, K, V = 2, 100, 2, 32, 32
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(B, T, H, K, V, gate, True, True, torch.bfloat16))
    h0 = h0.float()
    ref_o, ref_ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_close("o", ref_o.float(), o.float(), 5e-3)
    assert_close("ht", ref_ht, ht, 1e-5)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda], ids=["chunk", "fused_recurrent"])
def test_varlen_equals_loop_over_sequences(fn):
    H, K, V = 2, 32, 16
    cu_seqlens = torch.tensor([0, 15, 100, 100, 230, 231], dtype=torch.long)
    T, N = int(cu_seqlens[-1]), cu_seqlens.numel() - 1
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V, "softplus", False, True)
    h0 = torch.randn(N, H, K, V, requires_grad=True)
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
               cu_seqlens=cu_seqlens)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    dq, dk, dg, dh0 = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), (q, k, g, h0))
    ref_o, ref_ht = [], []
    for n in range(N):
        s, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o_n, ht_n = naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                        initial_state=h0[n : n + 1], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
        ref_o.append(o_n)
        ref_ht.append(ht_n)
    ref_o, ref_ht = torch.cat(ref_o, 1), torch.cat(ref_ht, 0)
    assert_close("o", ref_o, o, 1e-5)
    assert_close("ht", ref_ht, ht, 1e-5)
    # The empty sequence passes its state through untouched.
    torch.testing.assert_close(ht[2], h0[2])
    rq, rk, rg, rh0 = torch.autograd.grad((ref_o * do).sum() + (ref_ht * dht).sum(), (q, k, g, h0))
    for name, ref, got in (("dq", rq, dq), ("dk", rk, dk), ("dg", rg, dg), ("dh0", rh0, dh0)):
        assert_close(name, ref, got, 5e-5)


def test_prefix_then_decode_equals_one_call():
    """Prefill with chunk_kda, then decode the rest in pieces with fused_recurrent_kda, passing the state on."""
    B, T, H, K, V = 2, 100, 2, 32, 32
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(B, T, H, K, V, "lower_bound", True, True))
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    full_o, full_ht = chunk_kda(q, k, v, g, beta, initial_state=h0, **kw)
    ref_o, ref_ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, **kw)
    assert_close("full o", ref_o, full_o, 1e-5)
    pieces, state, bounds = [], h0, [0, 70, 71, 72, 75, 100]
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        fn = chunk_kda if i == 0 else fused_recurrent_kda
        o, state = fn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=state, **kw)
        pieces.append(o)
    assert_close("o", full_o, torch.cat(pieces, 1), 1e-5)
    assert_close("ht", full_ht, state, 1e-5)


def test_no_final_state_unless_asked_and_default_scale():
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in make_inputs(1, 20, 2, 16, 16, with_h0=False))
    for fn in (chunk_kda, fused_recurrent_kda, naive_recurrent_kda):
        o, ht = fn(q, k, v, g, beta)
        assert ht is None
        o2, _ = fn(q, k, v, g, beta, scale=16**-0.5)
        torch.testing.assert_close(o, o2)


def test_kda_gate_forms():
    B, T, H, K = 2, 5, 3, 4
    raw = torch.randn(B, T, H, K) * 3
    A_log = torch.randn(H + 2)  # longer than H: only the first H entries count
    dt_bias = torch.randn(H * K)
    a = A_log[:H].exp().view(H, 1)
    x = raw + dt_bias.view(H, K)
    torch.testing.assert_close(kda_gate(raw, A_log, dt_bias), -a * F.softplus(x))
    g = kda_gate(raw, A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(g, -5.0 * torch.sigmoid(a * x))
    assert g.dtype == torch.float32 and (g >= -5.0).all() and (g <= 0).all()  # fp32 sigmoid saturates
    assert kda_gate(raw.bfloat16(), A_log, dt_bias.view(H, K)).dtype == torch.float32
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(raw, A_log, torch.zeros(K))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(raw, torch.zeros(H - 1), dt_bias)


def test_fla_in_kernel_gate_keywords():
    """use_gate_in_kernel / use_beta_sigmoid_in_kernel mean the same on the PyTorch path as in fla."""
    B, T, H, K, V = 1, 70, 2, 16, 16
    q, k, v, _, _, h0 = (x.detach() for x in make_inputs(B, T, H, K, V))
    raw, beta_logits = torch.randn(B, T, H, K), torch.randn(B, T, H)
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    ref_o, _ = naive_recurrent_kda(q, k, v, kda_gate(raw, A_log, dt_bias, -5.0), beta_logits.sigmoid(), initial_state=h0)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, _ = fn(q, k, v, raw, beta_logits, initial_state=h0, use_gate_in_kernel=True, A_log=A_log,
                  dt_bias=dt_bias, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, safe_gate=True)
        assert_close("o", ref_o, o, 1e-5)
        with pytest.raises(TypeError, match="not_an_option"):
            fn(q, k, v, raw, beta_logits, not_an_option=1)


def test_shape_errors_are_precise():
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(2, 8, 2, 16, 16))
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 16, 16))


def test_backend_switch(monkeypatch):
    x = torch.zeros(1)
    assert kda.kda_backend() == "torch"  # set by the fixture through the env var
    monkeypatch.setenv("K3_KDA_BACKEND", "auto")
    assert kda.kda_backend() == "auto" and kda.kda_backend(x) == "torch"  # CPU tensors never go to fla
    set_kda_backend("torch")
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    assert kda.kda_backend(x) == "torch"  # the function overrides the env var
    set_kda_backend(None)
    assert kda.kda_backend() == "fla"
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 4, 1, 8, 8))
    with pytest.raises(RuntimeError, match="fla"):
        chunk_kda(q, k, v, g, beta)  # forced fla: either not importable here, or CPU tensors
    with pytest.raises(ValueError, match="set_kda_backend\\(name\\)='triton'; use auto, torch or fla"):
        set_kda_backend("triton")
    monkeypatch.setenv("K3_KDA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="K3_KDA_BACKEND"):
        kda.kda_backend()


def test_forcing_missing_fla_fails_clearly():
    if not isinstance(kda._load_fla(), str):
        pytest.skip("fla is installed here")
    with pytest.raises(RuntimeError, match="not importable"):
        set_kda_backend("fla")


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda, naive_recurrent_kda])
def test_zero_length_input_keeps_the_state(fn):
    x, beta, h0 = torch.randn(2, 0, 2, 8), torch.rand(2, 0, 2), torch.randn(2, 2, 8, 8)
    o, ht = fn(x, x, x, -x.abs(), beta, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 2, 8)
    torch.testing.assert_close(ht, h0)


def test_fla_found_but_cpu_tensors_fail_clearly(monkeypatch):
    """With an importable fla (a stand-in module here), forcing it on CPU tensors names the device problem."""
    import sys
    import types

    fake = types.ModuleType("fla.ops.kda")
    fake.chunk_kda = fake.fused_recurrent_kda = lambda **kw: pytest.fail("fla must not run on CPU tensors")
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fake)
    kda._load_fla.cache_clear()
    try:
        set_kda_backend("fla")
        assert kda.kda_backend() == "fla"
        q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 4, 1, 8, 8))
        with pytest.raises(RuntimeError, match="need CUDA"):
            fused_recurrent_kda(q, k, v, g, beta)
        set_kda_backend("auto")
        assert kda.kda_backend(q) == "torch"  # auto keeps CPU tensors on the PyTorch path
    finally:
        set_kda_backend(None)
        kda._load_fla.cache_clear()
