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
    """Dynamo keeps the launcher opaque (k3::moe_experts_triton) and its fake gives the right shape."""
    moe = _moe()
    x = torch.randn(2, 3, moe.routed_expert_down_proj.in_features)
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(moe, backend="aot_eager", fullgraph=True)(x)
        monkeypatch.setenv("K3_MOE_BACKEND", "loop")
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
    step = torch.compile(lambda x: x + 1 if moe_triton._triton_importable() else x - 1, backend="eager",
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
    the Triton kernels gives the tokens of a cache-free greedy loop over the PyTorch experts."""
    from k3.infer.engine import Engine, greedy_without_cache
    from k3.infer.sampling import SamplingParams
    from k3.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40)]
    monkeypatch.setenv("K3_MOE_BACKEND", "loop")
    want = [greedy_without_cache(model, p, 12) for p in prompts]
    import k3.ops.moe as moe_ops

    calls = []
    kernels = moe_ops.experts_triton
    monkeypatch.setattr(moe_ops, "experts_triton", lambda *args: calls.append(args[0].shape[0]) or kernels(*args))
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    engine = Engine(model, None, max_context=128, max_batch=4, page_size=16, prefill_chunk=16)
    assert engine.generate_ids(prompts, SamplingParams(max_new_tokens=12, temperature=0.0)) == want
    assert calls and min(calls) <= 2 * 2  # decode steps (one or two rows of top-2 pairs) went through the kernels
