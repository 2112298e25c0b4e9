"""The decode experts' Triton kernels (k3.ops.moe_triton) against the PyTorch loop.

Without a GPU they run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
imported), which executes the same kernel source the GPU compiles: masks, the loop over each expert's rows, the
fused GLU. The last test compiles them on CUDA in bf16.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")

from k3.config import ModelConfig  # noqa: E402
from k3.layers.moe import LatentMoE  # noqa: E402
from k3.ops import moe_triton  # noqa: E402
from k3.ops.moe import experts_loop  # noqa: E402
from k3.ops.triton_support import triton_importable  # noqa: E402


def _experts(num_experts, width_f, width_d, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, width_f, width_d, generator=g) / width_d ** 0.5
    w3 = torch.randn(num_experts, width_f, width_d, generator=g) / width_d ** 0.5
    w2 = torch.randn(num_experts, width_d, width_f, generator=g) / width_f ** 0.5
    return w1, w3, w2


@interpreted
@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("blocks", [None, ((16, 16, 16), (16, 32, 16))])
def test_kernels_equal_the_loop(act, blocks):
    # Widths that are no multiple of the blocks, empty experts, and one expert with more rows than BLOCK_M.
    counts = [3, 0, 20, 1, 0, 0, 5, 2]
    w1, w3, w2 = _experts(len(counts), 48, 40)
    x = torch.randn(sum(counts), 40, generator=torch.Generator().manual_seed(1))
    want = experts_loop(x, counts, w1, w3, w2, act, (4.0, 25.0))
    got = moe_triton.experts_triton_eager(x, torch.tensor(counts), w1, w3, w2, act, (4.0, 25.0), blocks)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_untouched_experts_are_never_read():
    counts = [0, 4, 0, 0, 2, 0]
    w1, w3, w2 = _experts(len(counts), 32, 32, seed=2)
    clean = [w.clone() for w in (w1, w3, w2)]
    for w in (w1, w3, w2):
        w[torch.tensor(counts) == 0] = float("nan")  # any read of an untouched expert would spread NaN
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(3))
    got = moe_triton.experts_triton_eager(x, torch.tensor(counts), w1, w3, w2, "situ", (4.0, 25.0))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, experts_loop(x, counts, *clean, "situ", (4.0, 25.0)), rtol=1e-5, atol=1e-5)


@interpreted
def test_no_rows():
    w1, w3, w2 = _experts(4, 16, 16)
    out = moe_triton.experts_triton_eager(torch.zeros(0, 16), torch.zeros(4, dtype=torch.long), w1, w3, w2,
                                          "silu", (4.0, 25.0))
    assert out.shape == (0, 16)


def test_block_sizes_split_columns_when_few_experts_are_touched():
    one_token = moe_triton.block_sizes(num_rows=6, num_experts=64, out_width=1024, in_width=512)
    many = moe_triton.block_sizes(num_rows=384, num_experts=64, out_width=1024, in_width=512)
    assert one_token[1] < many[1] == 64
    assert one_token[0] == many[0] == 16 and one_token[2] == 128


def _moe(**overrides):
    config = ModelConfig.from_preset("debug", **overrides)
    torch.manual_seed(0)
    moe = LatentMoE(config).eval()
    with torch.no_grad():
        for p in moe.parameters():  # every parameter: the suite's torch.empty is NaN-filled
            torch.nn.init.normal_(p, std=0.2)
    return moe


@interpreted
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_latent_moe_layer_takes_the_kernels_when_asked(monkeypatch, act):
    moe = _moe(hidden_act=act)
    x = torch.randn(3, 5, moe.w1.shape[2] if not moe.latent else moe.routed_expert_down_proj.in_features)
    with torch.no_grad():
        monkeypatch.setenv("K3_MOE_BACKEND", "loop")
        want = moe(x)
        monkeypatch.setenv("K3_MOE_BACKEND", "triton")
        got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_custom_op_under_compile(monkeypatch):
    """Dynamo keeps the launchers opaque (k3::moe_experts_by_ids_triton, k3::moe_route_triton) and their fakes
    give the right shapes."""
    moe = _moe()
    x = torch.randn(2, 3, moe.routed_expert_down_proj.in_features)
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    monkeypatch.setenv("K3_ROUTER_BACKEND", "triton")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(moe, backend="aot_eager", fullgraph=True)(x)
        monkeypatch.setenv("K3_MOE_BACKEND", "loop")
        monkeypatch.setenv("K3_ROUTER_BACKEND", "torch")
        want = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_kernels_equal_the_loop_cuda_bf16(act):
    counts = [3, 0, 20, 1, 0, 0, 5, 2] * 8  # 64 experts, `small`'s latent and expert widths
    w1, w3, w2 = (w.cuda().bfloat16() for w in _experts(len(counts), 1024, 512))
    x = torch.randn(sum(counts), 512, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    want = experts_loop(x.float(), counts, w1.float(), w3.float(), w2.float(), act, (4.0, 25.0))
    got = moe_triton.experts_triton_eager(x, torch.tensor(counts, device="cuda"), w1, w3, w2, act, (4.0, 25.0))
    assert (got.float() - want).norm() / want.norm() < 1e-2


def test_auto_selection_traces_under_compile():
    """The engine's compiled decode step asks triton_pays while tracing: the availability check must be a constant
    to dynamo (tracing the import inside it failed the compile)."""
    torch._dynamo.reset()
    step = torch.compile(lambda x: x + 1 if triton_importable() else x - 1, backend="eager",
                         fullgraph=True)
    assert torch.equal(step(torch.zeros(2)), torch.ones(2))


def test_a_kernel_triton_cannot_compile_falls_back_once(monkeypatch):
    """Auto-selected (not forced), a Triton compile failure warns once and the experts run without Triton."""
    import k3.ops.moe as moe_ops

    class CompilationError(Exception):  # the name Triton's compiler errors carry
        pass

    calls = []

    def failing(*args):
        calls.append(1)
        raise CompilationError("shared memory out of resource")

    monkeypatch.setattr(moe_ops, "triton_pays", lambda *args: True)
    monkeypatch.setattr(moe_ops, "experts_triton", failing)
    monkeypatch.setenv("K3_MOE_BACKEND", "auto")
    monkeypatch.setattr("k3.ops.fused_backend._failed", {})
    counts = [2, 0, 3]
    w1, w3, w2 = _experts(len(counts), 16, 16)
    x = torch.randn(sum(counts), 16)
    want = experts_loop(x, counts, w1, w3, w2, "silu", (4.0, 25.0))
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        got = moe_ops.run_experts(x, torch.tensor(counts), w1, w3, w2, "silu", (4.0, 25.0))
    torch.testing.assert_close(got, want)
    moe_ops.run_experts(x, torch.tensor(counts), w1, w3, w2, "silu", (4.0, 25.0))
    assert len(calls) == 1  # the variant stays off Triton

    def other_error(*args):
        raise ValueError("a bug, not a compile failure")

    monkeypatch.setattr(moe_ops, "experts_triton", other_error)
    with pytest.raises(ValueError):
        moe_ops.run_experts(x, torch.tensor(counts), w1, w3, torch.randn(3, 16, 16), "situ", (4.0, 25.0))


@interpreted
def test_engine_generates_the_same_tokens_with_the_kernels(monkeypatch):
    """The inference engine (chunked prefill, batched decode over the cache pool) with every routed-expert call on
    the Triton kernels gives the tokens of a cache-free greedy loop over the PyTorch experts, and the log
    probabilities of the same engine on them (tokens alone let a wrong scale through)."""
    from k3.infer.engine import Engine, greedy_without_cache
    from k3.infer.sampling import SamplingParams
    from k3.model import K3ForCausalLM

    torch.manual_seed(0)
    # Two layers (KDA, then MLA), both MoE: every interpreted expert launch is ~0.1 s, and two MoE layers take the
    # same calls as the preset's three.
    model = K3ForCausalLM(ModelConfig.from_preset("debug", num_layers=2, full_attn_layers=[2],
                                                  first_k_dense_replace=0)).eval()
    # 12 tokens prefill in one chunk, 30 in two (16 + 14); both cross a page (16 tokens) while decoding 6 more.
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 30)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=0)

    def engine_outputs():
        engine = Engine(model, None, max_context=128, max_batch=4, page_size=16, prefill_chunk=16)
        return [out.outputs[0] for out in engine.complete(prompts, params)]

    monkeypatch.setenv("K3_MOE_BACKEND", "loop")
    want = [greedy_without_cache(model, p, 6) for p in prompts]
    twin = engine_outputs()
    import k3.ops.moe as moe_ops

    calls = []
    kernels = moe_ops.experts_by_ids
    monkeypatch.setattr(moe_ops, "experts_by_ids", lambda *args: calls.append(args[1].numel()) or kernels(*args))
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    monkeypatch.setenv("K3_ROUTER_BACKEND", "triton")
    got = engine_outputs()
    assert [out.token_ids for out in got] == [out.token_ids for out in twin] == want
    for out, ref in zip(got, twin):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert calls and min(calls) <= 2 * 2  # decode steps (one or two rows of top-2 pairs) went through the kernels


def _pairs(num_tokens, top_k, num_experts, seed):
    """Expert ids of distinct experts per token, with expert 2 crowded (more pairs than BLOCK_M) and some
    experts never chosen."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 2] += 3.0  # chosen by nearly every token
    logits[:, -2:] -= 100.0  # never chosen
    return logits.topk(top_k, dim=-1).indices


def _sorted_reference(h_TD, ids_TK, w1, w3, w2, act):
    """The sorted path by hand: sort pairs, the expert loop, back in pair order."""
    ids_N = ids_TK.reshape(-1)
    order = ids_N.argsort(stable=True)
    y = experts_loop(h_TD[order // ids_TK.shape[1]], torch.bincount(ids_N, minlength=w1.shape[0]).tolist(),
                     w1, w3, w2, act, (4.0, 25.0))
    return y[torch.argsort(order)]


SHAPES = [
    (1, 3, None), (7, 2, ((16, 16, 16), (16, 32, 16))),
    (90, 3, ((16, 32, 32), (16, 32, 32))),  # 270 pairs, expert 2 over 5 row blocks
    # 240 pairs, experts over two row blocks; warps and stages given
    (80, 3, ((16, 32, 32, 2, 2), (16, 16, 64, 8, 4))),
]


# Each shape with both activations and each pair block with both, in half the full product: the activation is
# the GLU epilogue, the same code for any pair block and shape (every pair of choices is still run together).
# Pair blocks: the ids scanned in 2-3 chunks (128), or in one.
PAIR_ORDER_CASES = [(*shape, pair_block, ["silu", "situ"][(i + (pair_block == 128)) % 2])
                    for i, shape in enumerate(SHAPES) for pair_block in (128, moe_triton.PAIR_BLOCK)]


@interpreted
@pytest.mark.parametrize("num_tokens, top_k, blocks, pair_block, act", PAIR_ORDER_CASES)
def test_pair_order_kernels_equal_the_sorted_loop(num_tokens, top_k, blocks, pair_block, act, monkeypatch):
    monkeypatch.setattr(moe_triton, "PAIR_BLOCK", pair_block)
    w1, w3, w2 = _experts(10, 48, 40, seed=4)
    h = torch.randn(num_tokens, 40, generator=torch.Generator().manual_seed(5))
    ids = _pairs(num_tokens, top_k, 10, seed=6)
    got = moe_triton.experts_by_ids_eager(h, ids.reshape(-1), w1, w3, w2, act, (4.0, 25.0), blocks)
    torch.testing.assert_close(got, _sorted_reference(h, ids, w1, w3, w2, act), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("num_tokens, top_k, blocks", [
    (1, 3, None), (7, 2, ((16, 16, 16), (16, 32, 16))),
    # Expert 2 over 4 row blocks, the 150 ids scanned in 2 chunks: the lists stored and loaded per block (90 tokens,
    # 6 row blocks, added no branch and twice the interpreted programs).
    (50, 3, ((16, 32, 32), (16, 32, 32))),
])
def test_pair_lists_shared_between_the_kernels_equal_two_scans(num_tokens, top_k, blocks, monkeypatch):
    """The first projection stores each expert's pairs, the second loads them: the same rows, in the same order."""
    monkeypatch.setattr(moe_triton, "PAIR_BLOCK", 128)
    w1, w3, w2 = _experts(10, 48, 40, seed=4)
    h = torch.randn(num_tokens, 40, generator=torch.Generator().manual_seed(5))
    ids = _pairs(num_tokens, top_k, 10, seed=6).reshape(-1)
    args = (h, ids, w1, w3, w2, "situ", (4.0, 25.0), blocks)
    scanned = moe_triton.experts_by_ids_eager(*args, shared_lists=False)
    torch.testing.assert_close(moe_triton.experts_by_ids_eager(*args, shared_lists=True), scanned, rtol=0, atol=0)


@interpreted
def test_pair_lists_switch_is_read_from_the_environment(monkeypatch):
    """K3_MOE_PAIR_LISTS=1 turns the shared lists on (same result), an unknown value is refused. Apart from the
    test above: the switch's reading does not depend on the shape, so it runs once, at the smallest."""
    monkeypatch.setattr(moe_triton, "PAIR_BLOCK", 128)
    w1, w3, w2 = _experts(10, 48, 40, seed=4)
    h = torch.randn(1, 40, generator=torch.Generator().manual_seed(5))
    args = (h, _pairs(1, 3, 10, seed=6).reshape(-1), w1, w3, w2, "situ", (4.0, 25.0), None)
    scanned = moe_triton.experts_by_ids_eager(*args, shared_lists=False)
    monkeypatch.setenv("K3_MOE_PAIR_LISTS", "1")
    assert moe_triton.pair_lists_from_env()
    torch.testing.assert_close(moe_triton.experts_by_ids_eager(*args), scanned, rtol=0, atol=0)
    monkeypatch.setenv("K3_MOE_PAIR_LISTS", "yes")
    with pytest.raises(ValueError, match="K3_MOE_PAIR_LISTS"):
        moe_triton.experts_by_ids_eager(*args)


@interpreted
def test_pair_order_kernels_never_read_untouched_experts():
    w1, w3, w2 = _experts(8, 32, 32, seed=7)
    ids = _pairs(6, 2, 8, seed=8)
    clean = [w.clone() for w in (w1, w3, w2)]
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[ids.unique()] = False
    assert untouched.any()
    for w in (w1, w3, w2):
        w[untouched] = float("nan")
    h = torch.randn(6, 32, generator=torch.Generator().manual_seed(9))
    got = moe_triton.experts_by_ids_eager(h, ids.reshape(-1), w1, w3, w2, "situ", (4.0, 25.0))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _sorted_reference(h, ids, *clean, "situ"), rtol=1e-5, atol=1e-5)


@interpreted
def test_pair_order_kernels_over_no_tokens_and_bad_pairs():
    w1, w3, w2 = _experts(4, 16, 16)
    empty = moe_triton.experts_by_ids_eager(torch.zeros(0, 16), torch.zeros(0, dtype=torch.long), w1, w3, w2,
                                            "silu", (4.0, 25.0))
    assert empty.shape == (0, 16)
    with pytest.raises(ValueError, match="top_k pairs per token"):
        moe_triton.experts_by_ids_eager(torch.zeros(3, 16), torch.zeros(7, dtype=torch.long), w1, w3, w2,
                                        "silu", (4.0, 25.0))


def test_pair_order_falls_back_to_the_sorted_path_when_triton_cannot_compile(monkeypatch):
    import k3.ops.moe as moe_ops

    class CompilationError(Exception):
        pass

    def failing(*args):
        raise CompilationError("out of resource")

    # Only the pair-order call (it passes num_rows) takes Triton: the sorted path then runs without it, on any
    # device (real kernels on CPU tensors would need the interpreter, which a GPU machine does not set).
    monkeypatch.setattr(moe_ops, "triton_pays", lambda *args, num_rows=None: num_rows is not None)
    monkeypatch.setattr(moe_ops, "experts_by_ids", failing)
    monkeypatch.setenv("K3_MOE_BACKEND", "auto")
    monkeypatch.setattr("k3.ops.fused_backend._failed", {})
    w1, w3, w2 = _experts(6, 16, 16)
    h = torch.randn(5, 16)
    ids = _pairs(5, 2, 6, seed=10)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        got = moe_ops.experts_in_pair_order(h, ids.reshape(-1), 2, w1, w3, w2, "silu", (4.0, 25.0))
    torch.testing.assert_close(got, _sorted_reference(h, ids, w1, w3, w2, "silu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_pair_order_kernels_cuda_bf16(num_tokens):
    w1, w3, w2 = (w.cuda().bfloat16() for w in _experts(64, 1024, 512))
    h = torch.randn(num_tokens, 512, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    ids = _pairs(num_tokens, 6, 64, seed=11).cuda()
    want = _sorted_reference(h.float(), ids, w1.float(), w3.float(), w2.float(), "situ")
    got = moe_triton.experts_by_ids_eager(h, ids.reshape(-1), w1, w3, w2, "situ", (4.0, 25.0))
    assert (got.float() - want).norm() / want.norm() < 1e-2


@interpreted
def test_many_pairs_take_the_sorted_kernels(monkeypatch):
    """Past PAIR_ORDER_MAX_PAIRS the pair scan costs more than a sort: the sorted kernels run, same rows."""
    import k3.ops.moe as moe_ops

    monkeypatch.setattr(moe_ops, "PAIR_ORDER_MAX_PAIRS", 8)
    monkeypatch.setattr(moe_ops, "experts_by_ids", lambda *args: pytest.fail("pair-order kernels ran"))
    sorted_calls = []
    kernels = moe_ops.experts_triton
    monkeypatch.setattr(moe_ops, "experts_triton", lambda *args: sorted_calls.append(1) or kernels(*args))
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    w1, w3, w2 = _experts(6, 16, 16)
    h = torch.randn(5, 16)
    ids = _pairs(5, 2, 6, seed=12)  # 10 pairs
    got = moe_ops.experts_in_pair_order(h, ids.reshape(-1), 2, w1, w3, w2, "silu", (4.0, 25.0))
    assert sorted_calls == [1]
    torch.testing.assert_close(got, _sorted_reference(h, ids, w1, w3, w2, "silu"), rtol=1e-5, atol=1e-5)
