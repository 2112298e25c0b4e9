"""Decode KDA that advances its states in place, in their pool slots (k3.ops.kda.fused_recurrent_kda_inplace).

- The PyTorch twin equals the out-of-place recurrence (gather, fused_recurrent_kda, scatter) on outputs and on
  the slots it names, leaves every other slot bit for bit, and raises on an index outside the pool.
- fla's path, run on CPU against a stand-in that addresses states the way fla 0.6.0's kernel does (the slot
  index read at indices[row * stride + t], the state stored after every token), equals the twin; the same
  stand-in shows that [B] indices with T > 1 would write other rows' slots.
- A KDA layer decoding through the engine's CachePool and through StaticCache (both in place) gives the
  outputs and states of HybridCache (out of place).
- Under torch.compile the fla dispatch is one k3::fla_fused_recurrent_kda_inplace op per KDA layer, compiled
  equals eager through functionalisation (aot_eager), and Inductor hands the op the cache's buffer itself.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

import k3.layers.kda as kda_layer
import k3.ops.kda as kda_ops
from k3 import K3ForCausalLM, ModelConfig
from k3.cache import KDACacheSlot
from k3.infer.cache_pool import BatchCache, CachePool, KDAView
from bench.static_decode import decode_step
from k3.infer.runner import decode_logits
from bench.static_decode import StaticCache, StaticKDASlot
from k3.layers.fused_weights import fuse_model_weights
from k3.layers.kda import KimiDeltaAttention
from k3.ops.kda import fused_recurrent_kda, fused_recurrent_kda_inplace
from k3.ops.kda.fla_launch import KERNEL_ARGS, InplaceRecurrentLauncher, auto_launch, find_fla_recurrent_kernel
from k3.ops.kda.inplace import fused_recurrent_kda_inplace_fla, fused_recurrent_kda_inplace_torch
from k3.ops.kda.recurrent import fused_recurrent_kda_torch
from tests.ops import fla_standins

H, K, V = 2, 8, 8
SLOTS = 9


def decode_inputs(batch: int, length: int, seed: int) -> tuple[list[torch.Tensor], dict]:
    """Raw q, k, v, gate, beta logits [B, T, ...] and the layer's in-kernel options (K3's bounded gate)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, g = (torch.randn(batch, length, H, K, generator=gen) for _ in range(3))
    v = torch.randn(batch, length, H, V, generator=gen)
    beta = torch.randn(batch, length, H, generator=gen)
    options = dict(use_gate_in_kernel=True, A_log=torch.randn(H, generator=gen) * 0.5,
                   dt_bias=torch.randn(H * K, generator=gen), use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
                   safe_gate=True)
    return [q, k, v, g, beta], options


def random_pool(seed: int) -> torch.Tensor:
    return torch.randn(SLOTS, H, K, V, generator=torch.Generator().manual_seed(seed))


def out_of_place(inputs, options, pool, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """The old decode path: gather, fused_recurrent_kda, scatter into a copy of the pool."""
    after = pool.clone()
    o, final = fused_recurrent_kda(*inputs, initial_state=pool[indices], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, **options)
    after[indices] = final
    return o, after


# Unsorted, not contiguous (every other entry of a longer tensor), and int32 as well as int64.
INDEX_CASES = {
    "unsorted": torch.tensor([7, 2, 5, 0]),
    "strided": torch.tensor([8, 3, 1, 6, 4, 0, 2, 5])[::2],
    "int32": torch.tensor([3, 8, 1, 6], dtype=torch.int32),
}


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_inplace_twin_equals_out_of_place_and_leaves_other_slots(case, length):
    indices = INDEX_CASES[case]
    assert case != "strided" or not indices.is_contiguous()
    inputs, options = decode_inputs(4, length, seed=1)
    pool = random_pool(seed=2)
    before = pool.clone()
    expected_o, expected_pool = out_of_place(inputs, options, before, indices.long())
    o = fused_recurrent_kda_inplace(*inputs, pool, indices, use_qk_l2norm_in_kernel=True, **options)
    torch.testing.assert_close(o, expected_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-6, atol=1e-6)
    untouched = [s for s in range(SLOTS) if s not in indices.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    assert not torch.allclose(pool[indices.long()], before[indices.long()])  # the named slots did move
    # The comparison sees a wrong slot: the same step with two rows' slots swapped gives another pool.
    swapped = indices.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    _, wrong_pool = out_of_place(inputs, options, before, swapped.long())
    assert not torch.allclose(wrong_pool, pool)


def test_inplace_twin_rejects_indices_outside_the_pool_and_bad_layouts():
    inputs, options = decode_inputs(2, 1, seed=3)
    pool = random_pool(seed=4)
    before = pool.clone()
    for bad in ([1, SLOTS], [-1, 2]):  # fla's kernel would write outside the pool here
        with pytest.raises((IndexError, RuntimeError)):
            fused_recurrent_kda_inplace(*inputs, pool, torch.tensor(bad), **options)
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="state_indices must be \\[B\\]"):
        fused_recurrent_kda_inplace(*inputs, pool, torch.tensor([1, 2, 3]), **options)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_recurrent_kda_inplace(*inputs, pool, torch.tensor([1.0, 2.0]), **options)
    with pytest.raises(ValueError, match="fp32"):
        fused_recurrent_kda_inplace(*inputs, pool.double(), torch.tensor([1, 2]), **options)
    with pytest.raises(ValueError, match="contiguous"):
        fused_recurrent_kda_inplace(*inputs, pool.transpose(2, 3), torch.tensor([1, 2]), **options)
    with pytest.raises(ValueError, match="\\[S, H, K, V\\]"):
        fused_recurrent_kda_inplace(*inputs, pool[:, :1], torch.tensor([1, 2]), **options)


# --- fla's addressing, on CPU ---------------------------------------------------------------------------
def fla_fwd_standin(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                    output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                    ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                    lower_bound=None, out=None, **kwargs):
    """fla 0.6.0's fused_recurrent_kda_fwd in continuous-batching mode, step by step on CPU: row n starts from
    initial_state[idx[n * stride(0)]] and stores its state after token t at idx[n * stride(0) + t], reading the
    index memory flat (the kernel ignores the token stride)."""
    assert inplace_final_state and ssm_state_indices is not None and cu_seqlens is None and not state_v_first
    assert all(t.is_contiguous() for t in (q, k, v, g, beta)), "fla's launcher does not make inputs contiguous"
    assert initial_state.dtype == torch.float32 and initial_state[0].is_contiguous()
    batch, length = q.shape[:2]
    stride = ssm_state_indices.stride(0)
    flat = ssm_state_indices.as_strided((ssm_state_indices.untyped_storage().nbytes()
                                         // ssm_state_indices.element_size()
                                         - ssm_state_indices.storage_offset(),), (1,))

    def slot(n: int, t: int) -> int:
        return int(flat[n * stride + t])

    gate = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    state = initial_state[[slot(n, 0) for n in range(batch)]]
    outs = []
    for t in range(length):
        o_t, state = fused_recurrent_kda_torch(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                               beta[:, t:t + 1], scale=scale, initial_state=state,
                                               output_final_state=True,
                                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **gate)
        outs.append(o_t)
        for n in range(batch):
            initial_state[slot(n, t)] = state[n]
    return torch.cat(outs, dim=1), initial_state


def fla_call(inputs, options, pool, indices):
    gate = {name: value for name, value in options.items() if name != "safe_gate"}
    return fused_recurrent_kda_inplace_fla(fla_fwd_standin, *inputs, pool, indices, None, True, **gate)


@pytest.mark.parametrize("length", [1, 4])
def test_fla_path_addresses_the_slots_like_the_twin(length):
    indices = INDEX_CASES["strided"]
    inputs, options = decode_inputs(4, length, seed=5)
    inputs = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in inputs]  # not contiguous: made so
    pool, twin_pool = random_pool(seed=6), random_pool(seed=6)
    o = fla_call(inputs, options, pool, indices)
    expected = fused_recurrent_kda_inplace(*inputs, twin_pool, indices, use_qk_l2norm_in_kernel=True, **options)
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, twin_pool, rtol=1e-5, atol=1e-5)


def test_fla_kernel_with_one_index_per_row_and_several_tokens_writes_other_rows_slots():
    """Why T > 1 passes [B, T] indices: with [B] ones the kernel stores row n's state after token 1 in row
    n+1's slot, and the last row's at whatever lies past the end of the indices (here a 0 behind them). The
    stand-in runs the rows in lock step (each reads its initial state before any row writes); on the GPU the
    programs' order decides which corrupted value a slot ends with."""
    indices = torch.tensor([4, 1, 7, 0])[:3]
    inputs, options = decode_inputs(3, 2, seed=7)
    gate = {name: value for name, value in options.items() if name != "safe_gate"}
    pool, twin_pool = random_pool(seed=8), random_pool(seed=8)
    fla_fwd_standin(*inputs, initial_state=pool, ssm_state_indices=indices, use_qk_l2norm_in_kernel=True, **gate)
    fused_recurrent_kda_inplace(*inputs, twin_pool, indices, use_qk_l2norm_in_kernel=True, **options)
    torch.testing.assert_close(pool[[1, 7, 0]], twin_pool[[4, 1, 7]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(pool[4], twin_pool[4])


def test_fla_without_the_inplace_launcher_gathers_runs_fla_and_scatters(monkeypatch):
    """An fla whose fused_recurrent_kda_fwd is missing (here: the stand-ins have none) keeps working, through
    its public out-of-place kernel."""
    indices = INDEX_CASES["int32"]
    inputs, options = decode_inputs(4, 2, seed=16)
    pool, twin_pool = random_pool(seed=17), random_pool(seed=17)
    with fla_standins.installed(monkeypatch):
        assert kda_ops._load_fla()[2] is None
        o = fused_recurrent_kda_inplace(*inputs, pool, indices, use_qk_l2norm_in_kernel=True, **options)
    expected = fused_recurrent_kda_inplace(*inputs, twin_pool, indices, use_qk_l2norm_in_kernel=True, **options)
    torch.testing.assert_close(o, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, twin_pool, rtol=1e-6, atol=1e-6)


class KernelStandin:
    """fla 0.6.0's fused_recurrent_kda_fwd_kernel as k3's launcher (k3/ops/kda/fla_launch.py) calls it: checks
    the arguments of the in-place mode against the tensors they describe, records the launch, and runs
    fla_fwd_standin on what the kernel would read (o written into the buffer it was handed)."""

    arg_names = sorted(KERNEL_ARGS | {"USE_INITIAL_STATE", "IS_VARLEN", "IS_CONTINUOUS_BATCHING",
                                      "IS_SPEC_DECODING", "STORE_FINAL_STATE", "HAS_A", "HAS_BIAS",
                                      "USE_LOWER_BOUND", "num_stages"})

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(**a):
            pool, indices = a["h0"], a["ssm_state_indices"]
            assert a["ht"] is pool and a["INPLACE_FINAL_STATE"] and a["cu_seqlens"] is None
            assert a["num_accepted_tokens"] is None and not a["STATE_V_FIRST"] and not a["ALLOW_NEG_EIGVAL"]
            q, v = a["q"], a["v"]
            assert (a["N"], a["T"], a["H"], a["K"]) == tuple(q.shape) and (a["HV"], a["V"]) == v.shape[2:]
            assert a["BK"] == a["K"] and a["IS_BETA_HEADWISE"] == (a["beta"].dim() == v.dim())
            assert grid == (-(-a["V"] // a["BV"]) * a["N"] * a["HV"],)
            assert a["stride_init_state_token"] == a["stride_final_state_token"] == pool.stride(0)
            assert a["stride_indices_seq"] == indices.stride(0)
            assert a["o"].shape == v.shape and a["o"].dtype == v.dtype
            self.launches.append((a["BV"], a["num_warps"], a["num_stages"]))
            o, _ = fla_fwd_standin(q, a["k"], v, a["g"], a["beta"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                                   initial_state=pool, scale=a["scale"], ssm_state_indices=indices,
                                   use_qk_l2norm_in_kernel=a["USE_QK_L2NORM_IN_KERNEL"],
                                   use_gate_in_kernel=a["USE_GATE_IN_KERNEL"],
                                   use_beta_sigmoid_in_kernel=a["APPLY_BETA_SIGMOID"], lower_bound=a["lower_bound"])
            a["o"].copy_(o)
        return run


@pytest.mark.parametrize("length", [1, 3])
def test_k3_launch_of_fla_kernel_addresses_the_slots_like_the_twin(monkeypatch, length):
    """k3 launches fla's kernel itself with the tile auto_launch picks (or K3_KDA_RECURRENT_LAUNCH names); the
    arguments it computes address the same slots and give the twin's outputs and states."""
    kernel, fla_calls = KernelStandin(), []
    launcher = InplaceRecurrentLauncher(lambda *a, **kw: fla_calls.append(1) or fla_fwd_standin(*a, **kw), kernel)
    inputs, options = decode_inputs(4, length, seed=21)
    gate = {name: value for name, value in options.items() if name != "safe_gate"}
    twin_pool = random_pool(seed=22)
    expected = fused_recurrent_kda_inplace(*inputs, twin_pool, INDEX_CASES["strided"], use_qk_l2norm_in_kernel=True,
                                           **options)
    for env, launch, through_fla in (("auto", auto_launch(4), 0), ("8,2,3", (8, 2, 3), 0), ("fla", None, 1)):
        monkeypatch.setenv("K3_KDA_RECURRENT_LAUNCH", env)
        pool, launches = random_pool(seed=22), len(kernel.launches)
        o = fused_recurrent_kda_inplace_fla(launcher, *inputs, pool, INDEX_CASES["strided"], None, True, **gate)
        torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool, twin_pool, rtol=1e-5, atol=1e-5)
        assert kernel.launches[launches:] == ([] if launch is None else [launch]) and len(fla_calls) == through_fla
    assert auto_launch(1) == (16, 1, 2) and auto_launch(64) == (16, 2, 2)
    for bad in ("12,2,2", "16,3,2", "16,2", "fast"):
        monkeypatch.setenv("K3_KDA_RECURRENT_LAUNCH", bad)
        with pytest.raises(ValueError, match="K3_KDA_RECURRENT_LAUNCH"):
            fused_recurrent_kda_inplace_fla(launcher, *inputs, random_pool(seed=22), INDEX_CASES["strided"], None,
                                            True, **gate)


def test_fla_kernel_is_launched_by_k3_only_when_its_signature_matches(monkeypatch):
    """_load_fla wraps fla's launcher around its kernel where the kernel takes k3's arguments; a kernel with
    another signature (another fla) leaves fla's own launcher in place."""
    old_kernel = KernelStandin()
    old_kernel.arg_names = [name for name in KernelStandin.arg_names if name != "stride_indices_tok"]
    for kernel, ours in ((KernelStandin(), True), (old_kernel, False)):
        with fla_standins.installed(monkeypatch):
            module = types.ModuleType("fla.ops.kda.fused_recurrent")
            module.fused_recurrent_kda_fwd, module.fused_recurrent_kda_fwd_kernel = fla_fwd_standin, kernel
            monkeypatch.setattr(sys.modules["fla.ops.kda"], "fused_recurrent", module, raising=False)
            kda_ops._load_fla.cache_clear()
            launcher = kda_ops._load_fla()[2]
            assert isinstance(launcher, InplaceRecurrentLauncher) == ours
            assert ours or launcher is fla_fwd_standin
            assert ours or "stride_indices_tok" in find_fla_recurrent_kernel(sys.modules["fla.ops.kda"])
        kda_ops._load_fla.cache_clear()


def cuda_pool_inputs(batch, length, seed, heads=8, dim=128):
    """`small`'s KDA shape on the GPU: bf16 [q, k, v, g, beta], the in-kernel gate options, an fp32 pool of
    2 * batch + 1 slots and `batch` distinct int32 slot indices into it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    inputs = [rand(batch, length, heads, dim) for _ in range(3)] + [rand(batch, length, heads, dim),
                                                                     rand(batch, length, heads)]
    inputs[2], inputs[3] = inputs[3], inputs[2]  # q, k, v, g, beta
    options = dict(use_gate_in_kernel=True, A_log=rand(heads, dtype=torch.float32),
                   dt_bias=rand(heads * dim, dtype=torch.float32), use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    start = rand(2 * batch + 1, heads, dim, dim, dtype=torch.float32).mul_(0.1)
    indices = torch.randperm(2 * batch + 1, device="cuda", generator=gen)[:batch].int()
    return inputs, options, start, indices


@pytest.mark.skipif(not (torch.cuda.is_available() and kda_ops._fla_available()), reason="needs CUDA and fla")
@pytest.mark.parametrize("batch,length", [(1, 1), (5, 1), (64, 1), (3, 4)])
def test_k3_launch_equals_fla_launch_on_cuda(monkeypatch, batch, length):
    """The real kernel under k3's launch against fla's own launcher: states to fp32 rounding, bf16 outputs to a
    unit or so of their last place (another tile width)."""
    inputs, options, start, indices = cuda_pool_inputs(batch, length, seed=batch)
    assert isinstance(kda_ops._load_fla()[2], InplaceRecurrentLauncher)  # fla's kernel takes k3's arguments
    results = {}
    for env in ("fla", "auto", "16,2,2"):
        monkeypatch.setenv("K3_KDA_RECURRENT_LAUNCH", env)
        pool = start.clone()
        with torch.no_grad():
            o = fused_recurrent_kda_inplace(*inputs, pool, indices, use_qk_l2norm_in_kernel=True, **options)
        results[env] = o.float(), pool
    want_o, want_pool = results.pop("fla")
    assert not torch.equal(want_pool, start)
    for o, pool in results.values():
        assert ((pool - want_pool).abs().max() / want_pool.abs().max()).item() < 1e-5
        assert ((o - want_o).abs().max() / want_o.abs().max()).item() < 1e-2


@pytest.mark.skipif(not (torch.cuda.is_available() and kda_ops._fla_available()), reason="needs CUDA and fla")
@pytest.mark.parametrize("batch,length", [(5, 1), (3, 14), (6, 12)])
def test_fla_path_equals_the_twin_on_cuda(batch, length):
    """What the engine runs on the GPU (one decode token, or a short prefill chunk of several rows) against the
    PyTorch twin on the same bf16 inputs and fp32 pool: states to a bf16 input's rounding, outputs likewise. A row
    of several tokens once went through fla's in-place launcher, which hung (3 rows of 11-14 tokens) or gave other
    states (6 rows of 2-12 tokens) inside the engine on one H100."""
    (q, k, v, g, beta), options, start, indices = cuda_pool_inputs(batch, length, seed=batch * 100 + length)
    pool, twin_pool = start.clone(), start.clone()
    with torch.no_grad():
        o = fused_recurrent_kda_inplace(q, k, v, g, beta, pool, indices, use_qk_l2norm_in_kernel=True, **options)
        want = fused_recurrent_kda_inplace_torch(q.float(), k.float(), v.float(), g.float(), beta.float(), twin_pool,
                                                indices, None, True, **options)
    others = torch.ones(2 * batch + 1, dtype=torch.bool, device="cuda")
    others[indices.long()] = False
    assert torch.equal(pool[others], start[others])  # slots no row names are untouched
    assert ((pool - twin_pool).abs().max() / twin_pool.abs().max()).item() < 1e-2
    assert ((o.float() - want).abs().max() / want.abs().max()).item() < 2e-2


# --- the layer through the three caches -------------------------------------------------------------------
def kda_config() -> ModelConfig:
    return ModelConfig.from_preset("debug", kda_gate="lower_bound")


def prefilled_layer_caches(layer, config, prompt, pool_slots, seed):
    """HybridCache's slot after the prompt, and the same state and tails copied into a CachePool (at
    pool_slots, every other slot random) and a StaticKDASlot."""
    hybrid = KDACacheSlot()
    with torch.no_grad():
        layer(prompt, hybrid)
    pool = CachePool(config, num_slots=6, num_pages=2, page_size=4, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    pool.kda_state.copy_(torch.randn(pool.kda_state.shape, generator=gen))
    pool.kda_tails.copy_(torch.randn(pool.kda_tails.shape, generator=gen))
    view = KDAView(pool, layer.layer_index, pool_slots)
    view.update(hybrid.state, hybrid.conv_tails)
    static = StaticKDASlot(config, prompt.shape[0], torch.device("cpu"), torch.float32)
    static.update(hybrid.state, hybrid.conv_tails)
    return hybrid, pool, view, static


def test_layer_decodes_through_pool_and_static_cache_like_through_hybrid_cache(monkeypatch):
    config = kda_config()
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config, config.layer_types.index("kda"))
    layer.reset_gate_parameters()
    calls = []
    monkeypatch.setattr(kda_layer, "fused_recurrent_kda_inplace",
                        lambda *a, **kw: calls.append(a[5]) or fused_recurrent_kda_inplace(*a, **kw))
    slots = torch.tensor([5, 2, 3])
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randn(3, 20, config.hidden_size, generator=gen)  # prefill: the chunked path
    hybrid, pool, view, static = prefilled_layer_caches(layer, config, prompt, slots, seed=10)
    others = [s for s in range(pool.num_slots + 1) if s not in slots.tolist()]
    other_states = pool.kda_state[:, others].clone()
    steps = [torch.randn(3, t, config.hidden_size, generator=gen) for t in (1, 1, 3, 1)]
    with torch.no_grad():
        for x in steps:
            expected = layer(x, hybrid)
            for cache in (view, static):
                torch.testing.assert_close(layer(x, cache), expected, rtol=1e-5, atol=1e-5)
    for got_state, got_tails in ((view.state, view.conv_tails), (static.state, static.conv_tails)):
        torch.testing.assert_close(got_state, hybrid.state, rtol=1e-5, atol=1e-5)
        for got, want in zip(got_tails, hybrid.conv_tails, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(pool.kda_state[:, others], other_states)
    # Every decode step went in place, into the pool's layer buffer and into the static state itself.
    assert len(calls) == 2 * len(steps)
    assert calls[0].data_ptr() == pool.kda_state[view.n].data_ptr() and calls[1] is static.state


# --- under torch.compile, with fla's dispatch taken on CPU --------------------------------------------------
@pytest.fixture(scope="module")
def model():
    # The debug preset cut to three layers (KDA, MLA, KDA; dense MLP, then MoE): two KDA layers, so each one's own
    # in-place op and pool layer are checked, and dynamo (most of the compiled tests' time) traces three, not four.
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug", num_layers=3, full_attn_layers=[2])).eval()


@pytest.fixture
def fla_inplace(monkeypatch):
    """tests/ops/fla_standins.py's fla, plus the in-place launcher above as fla.ops.kda.fused_recurrent."""
    with fla_standins.installed(monkeypatch):
        module = types.ModuleType("fla.ops.kda.fused_recurrent")
        module.fused_recurrent_kda_fwd = fla_fwd_standin
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(sys.modules["fla.ops.kda"], "fused_recurrent", module, raising=False)
        kda_ops._load_fla.cache_clear()
        assert kda_ops._load_fla()[2] is fla_fwd_standin
        torch._dynamo.reset()  # a graph traced with another fla must not be reused
        yield
    torch._dynamo.reset()


def prefilled_static(model, batch=2, prompt=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt + 2), generator=gen)
    hybrid = model.new_cache(batch)
    with torch.no_grad():
        model(ids[:, :prompt], cache=hybrid)
    return StaticCache.from_hybrid(model.config, hybrid, 16, dtype=torch.float32), ids[:, prompt:]


def static_buffers(cache):
    return [t for slot in cache.layers for t in slot.buffers()]


def test_compiled_static_decode_takes_one_inplace_op_per_kda_layer_and_equals_eager(model, fla_inplace):
    twin_cache, ids = prefilled_static(model)
    kda_ops.set_kda_backend("torch")
    try:
        expected = [decode_step(model, twin_cache, ids[:, t:t + 1]) for t in range(2)]
    finally:
        kda_ops.set_kda_backend(None)
    graphs = []
    run_as = []  # which of the two the next call runs: Dynamo's graph as traced, or it functionalised

    def record(gm, example_inputs):  # one trace (most of the test's time) serves both
        graphs.append(gm)
        functionalised = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        return lambda *args: (gm.forward if run_as[-1] == "traced" else functionalised)(*args)

    eager_cache, _ = prefilled_static(model)
    recorded_cache, _ = prefilled_static(model)
    compiled_cache, _ = prefilled_static(model)
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=False, backend=record)
    for t in range(2):
        step_ids = ids[:, t:t + 1]
        got = [decode_step(model, eager_cache, step_ids)]
        for how, cache in (("traced", recorded_cache), ("functionalised", compiled_cache)):
            run_as.append(how)
            got.append(compiled(model, cache, step_ids))
        for one in got:
            torch.testing.assert_close(one, expected[t], rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1  # no recompile: both ran the one trace
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("k3.fla_fused_recurrent_kda_inplace.default") == model.config.layer_types.count("kda")
    assert targets.count("k3.fla_fused_recurrent_kda.default") == 0
    for cache in (eager_cache, recorded_cache, compiled_cache):
        for got, want in zip(static_buffers(cache), static_buffers(twin_cache), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_static_decode_hands_the_inplace_op_contiguous_inputs(model, fla_inplace):
    """Inductor keeps the strides a custom op was traced with, and fla's launcher needs q, k, v, g, beta
    contiguous: traced as slices (of the joined conv output, of the fused input GEMM), they were made contiguous
    inside the op's body, one aten copy each at every replay (48 in a batch-64 step of `small` on one H200). The
    graph now makes them contiguous before the op, where Inductor writes them so from the producing kernels."""
    fused = copy.deepcopy(model)
    fuse_model_weights(fused)  # q, k, v through one joined conv, beta from the fused input projection
    cache, ids = prefilled_static(fused)
    assert ids.shape[0] > 1  # at one row every one of those slices is contiguous anyway
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(decode_step, fullgraph=True, dynamic=False, backend=record)(fused, cache, ids[:, :1])
    ops = [n for n in graphs[0].graph.nodes if str(n.target) == "k3.fla_fused_recurrent_kda_inplace.default"]
    assert len(ops) == fused.config.layer_types.count("kda")
    for node in ops:
        for name, arg in zip("q k v g beta".split(), node.args[:5]):
            assert arg.meta["example_value"].is_contiguous(), f"{node.name}: {name} is not contiguous"


def test_compiled_engine_decode_writes_the_pool_like_eager(model, fla_inplace):
    def pool_and_cache():
        pool = CachePool(model.config, num_slots=5, num_pages=6, page_size=4, device="cpu", dtype=torch.float32)
        gen = torch.Generator().manual_seed(11)
        for buffer in (pool.kda_state, pool.kda_tails, pool.latent, pool.k_rope):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
        cache = BatchCache(pool, torch.tensor([4, 1, 3]), torch.tensor([[1, 2], [3, 4], [5, 6]]),
                           torch.tensor([5, 2, 7]), mask_rows=True)
        return pool, cache

    ids = torch.tensor([[5], [7], [9]])
    kda_ops.set_kda_backend("torch")
    try:
        twin_pool, cache = pool_and_cache()
        expected = decode_logits(model, ids, cache)
    finally:
        kda_ops.set_kda_backend(None)
    pool, cache = pool_and_cache()
    got = torch.compile(decode_logits, fullgraph=True, backend="aot_eager")(model, ids, cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.kda_state, twin_pool.kda_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.kda_state[:, [0, 2, 5]], pool_and_cache()[0].kda_state[:, [0, 2, 5]])


@pytest.mark.parametrize("length", [1, 3])
def test_inplace_op_declares_its_write_and_has_a_matching_fake(fla_inplace, length):
    """torch.library.opcheck: the schema test runs the op and fails on an undeclared write to state_pool; the
    fake and AOT dispatch tests compare the fake with the kernel (shapes, dtypes, strides)."""
    inputs, options = decode_inputs(3, length, seed=14)
    args = (*inputs, random_pool(seed=15), torch.tensor([6, 0, 3]), None, True, options["use_gate_in_kernel"],
            options["A_log"], options["dt_bias"], options["use_beta_sigmoid_in_kernel"], options["lower_bound"])
    torch.library.opcheck(kda_ops.fla_fused_recurrent_kda_inplace_op, args)


def test_inductor_hands_the_op_the_cache_buffer_itself(fla_inplace):
    """Functionalisation turns the op's write into a new pool plus a copy back; Inductor must undo that and
    pass (a view of) the cache's own buffer, else every step would copy a whole layer's pool."""
    from torch._inductor.utils import run_and_get_code

    inputs, options = decode_inputs(3, 1, seed=12)
    options.pop("safe_gate")
    layers_pool = torch.randn(2, SLOTS, H, K, V, generator=torch.Generator().manual_seed(13))
    indices = torch.tensor([6, 0, 3])

    def step(layers_pool, indices, q, k, v, g, beta):
        o = fused_recurrent_kda_inplace(q * 2, k, v, g, beta, layers_pool[1], indices,
                                        use_qk_l2norm_in_kernel=True, **options)
        return o + 1, layers_pool[1, indices].sum((-1, -2))  # a read after the write must see it

    twin = layers_pool.clone()
    kda_ops.set_kda_backend("torch")
    try:
        expected = step(twin, indices, *inputs)
    finally:
        kda_ops.set_kda_backend(None)
    got, codes = run_and_get_code(torch.compile(step, fullgraph=True), layers_pool, indices, *inputs)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layers_pool, twin, rtol=1e-5, atol=1e-5)
    code = "\n".join(codes)
    call = next(line for line in code.splitlines() if "torch.ops.k3.fla_fused_recurrent_kda_inplace" in line)
    assert "reinterpret_tensor(arg" in call or "reinterpret_tensor(primals" in call, call
    assert "clone" not in code and ".copy_(" not in code, code
