"""The one-token decode step through torch.compile, checked on CPU over the debug preset cut to three layers (KDA,
MLA, KDA: dense and latent-MoE feed-forwards, two AttnRes blocks; dynamo's tracing is most of the time) in fp32:

- dynamo traces the whole step (16 layers would be the same) as one graph with no breaks, on the PyTorch twins
  and with every fla dispatch taken (CPU stand-ins for fla: tests/ops/fla_standins.py), where each kernel is
  one k3:: custom op in the graph;
- the compiled step equals the eager one in the logits and in every cache buffer, step after step, and does
  not recompile from step to step nor for a fresh cache of the same shapes;
- the engine's decode forward over the cache pool (k3.infer.runner) is one graph too.

An Inductor compile of this model takes ~30 s on 2 CPU cores without its on-disk cache (~4 s with it), so the
tests that compile with Inductor (compiled_decode_step itself, the engine with K3_COMPILE_DECODE=1, bench/decode.py
--compile's CPU path) are slow; the default run checks the same traced graph through aot_eager (dynamo, AOT
autograd and the functionalised cache writes, without Inductor's code generation).
"""

import importlib
from pathlib import Path

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
from k3.infer.cache_pool import BatchCache, CachePool
from k3.infer.runner import compile_decode_from_env
from bench.static_decode import compiled_decode_step, decode_step
from k3.infer.runner import decode_logits
from bench.static_decode import StaticCache
from k3.ops.attn_res import set_attn_res_backend
from tests.ops import fla_standins

STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", num_layers=3, full_attn_layers=[2])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res.proj.weight"):  # non-uniform AttnRes mixes
                p.normal_(std=0.5)
    kinds = model.config.layer_types
    assert kinds.count("kda") == 2 and "mla" in kinds and model.routers() and model.config.attn_res_block_size > 0
    return model


def prefilled(model, batch=2, prompt=6, capacity=16, seed=1):
    """A StaticCache continuing a random prompt, and the ids of STEPS more tokens [B, STEPS]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt + STEPS), generator=gen)
    hybrid = model.new_cache(batch)
    with torch.no_grad():
        model(ids[:, :prompt], cache=hybrid)
    return StaticCache.from_hybrid(model.config, hybrid, capacity, dtype=torch.float32), ids[:, prompt:]


def buffers(cache: StaticCache) -> list[torch.Tensor]:
    return [cache.position] + [t for slot in cache.layers for t in slot.buffers()]


def check_compiled_equals_eager(model, step) -> None:
    """STEPS compiled steps equal STEPS eager ones (logits, every cache buffer); only the first step compiles."""
    eager_cache, ids = prefilled(model)
    compiled_cache, _ = prefilled(model)
    for t in range(STEPS):
        expected = decode_step(model, eager_cache, ids[:, t:t + 1])
        if t == 0:
            got = step(model, compiled_cache, ids[:, t:t + 1])
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                got = step(model, compiled_cache, ids[:, t:t + 1])
        torch.testing.assert_close(got, expected, **TOL)
    for got, expected in zip(buffers(compiled_cache), buffers(eager_cache), strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    assert int(compiled_cache.position) == 6 + STEPS
    fresh, ids = prefilled(model, seed=2)  # a new cache of the same shapes reuses the graph
    with torch.compiler.set_stance("fail_on_recompile"):
        step(model, fresh, ids[:, :1])


# test_compiled_decode_equals_eager_without_recompiles compiles the same step of the same model and cache with
# fullgraph=True, which raises at any graph break: the default run checks this there, without a second trace.
@pytest.mark.slow
def test_decode_step_is_one_graph_without_breaks(model):
    cache, ids = prefilled(model)
    explained = torch._dynamo.explain(decode_step)(model, cache, ids[:, :1])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("configured", ["fla", "auto"])
def test_decode_step_with_every_fla_dispatch_is_one_graph_of_custom_ops(model, monkeypatch, configured):
    """The CUDA dispatch decisions (fla for the short convs, norms and the KDA recurrence; the compiled AttnRes
    backend), taken on CPU with stand-ins: one graph (fullgraph), each fla call a k3:: op, results equal eager.
    With K3_FUSED_BACKEND=auto the norms are the PyTorch twins in the graph (Inductor fuses them); forced fla
    keeps them as ops."""
    with fla_standins.installed(monkeypatch, configured):
        check_fla_dispatch_graph(model, norm_ops=configured == "fla")


def check_fla_dispatch_graph(model, norm_ops: bool = True) -> None:
    eager_cache, ids = prefilled(model)
    expected = decode_step(model, eager_cache, ids[:, :1])
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    set_attn_res_backend("compiled")
    try:
        cache, _ = prefilled(model)
        got = torch.compile(decode_step, fullgraph=True, dynamic=False, backend=record)(model, cache, ids[:, :1])
    finally:
        set_attn_res_backend(None)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    kda_layers = model.config.layer_types.count("kda")
    # A one-token step's short convs are plain elementwise math under compile (short_conv_step), not fla calls.
    assert targets.count("k3.fla_causal_conv1d.default") == 0
    assert targets.count("k3.fla_fused_recurrent_kda.default") == kda_layers
    if norm_ops:
        assert targets.count("k3.fla_rms_norm_gated.default") == kda_layers
        assert targets.count("k3.fla_rms_norm.default") >= 2 * model.config.num_layers + 1
    else:
        assert not any(t.startswith("k3.fla_rms_norm") for t in targets)
        assert sum("rsqrt" in t for t in targets) >= 2 * model.config.num_layers + 1 + kda_layers
    torch.testing.assert_close(got, expected, **TOL)
    for a, b in zip(buffers(cache), buffers(eager_cache), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_compiled_decode_equals_eager_without_recompiles(model):
    check_compiled_equals_eager(model, torch.compile(decode_step, fullgraph=True, dynamic=False,
                                                     backend="aot_eager"))


@pytest.mark.slow
def test_inductor_compiled_decode_equals_eager_without_recompiles(model):
    check_compiled_equals_eager(model, compiled_decode_step())


# The `small` preset's layout and switches (16 layers, MLA at 4/8/12/16, AttnRes blocks of 4 so up to five
# sources, lower-bound KDA gate, full-rank KDA output gate, q_lora, MLA output gate, latent MoE with its norm,
# SiTU, QB, a shared expert, top-6 routing) at widths that run on CPU. On one H200, bench/decode.py --compile saw
# the bf16 compiled step of `small` 0.49-0.83 (||d|| / ||eager||) from the eager step. That is not the compile:
# at full size on CPU, fp32 compiled equals eager to 3e-6 while bf16 compiled is 0.46 from bf16 eager, and bf16
# eager itself is 1.18 from fp32 (the expert set differs in 14 of 15 MoE layers). At random init the latent norm
# scales the routed output to unit RMS, so each routing flip moves the stream a lot; with moe_latent_norm=False
# the bf16 gaps drop to 0.015 (compiled vs eager) and 0.058 (eager vs fp32).
SMALL_LIKE = dict(vocab_size=512, hidden_size=64, kda_num_heads=2, kda_head_dim=16, mla_num_heads=2, q_lora_rank=24,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                  num_experts=8, moe_intermediate_size=32, moe_latent_size=32)


@pytest.fixture(scope="module")
def small_like_model():
    torch.manual_seed(0)
    config = ModelConfig.from_preset("small", **SMALL_LIKE)
    small = ModelConfig.from_preset("small")
    for field in ("num_layers", "layer_types", "attn_res_block_size", "kda_gate", "kda_output_gate",
                  "mla_output_gate", "moe_latent_norm", "hidden_act", "moe_balancing", "num_shared_experts",
                  "num_experts_per_tok", "first_k_dense_replace"):
        assert getattr(config, field) == getattr(small, field), field
    model = K3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res.proj.weight"):
                p.normal_(std=0.5)
    return model


@pytest.mark.slow  # 27-39 s on 2 cores: the default suite stays near 15 minutes
def test_compiled_decode_over_the_small_layout_equals_eager(small_like_model):
    check_compiled_equals_eager(small_like_model, torch.compile(decode_step, fullgraph=True, dynamic=False,
                                                                backend="aot_eager"))


@pytest.mark.slow
def test_inductor_compiled_decode_over_the_small_layout_equals_eager(small_like_model, monkeypatch):
    """Inductor, with every fla dispatch taken through the CPU stand-ins (the k3:: custom ops in the graph)."""
    with fla_standins.installed(monkeypatch):
        set_attn_res_backend("compiled")
        try:
            check_compiled_equals_eager(small_like_model, torch.compile(decode_step, fullgraph=True, dynamic=False))
        finally:
            set_attn_res_backend(None)


def test_engine_decode_forward_is_one_graph(model):
    pool = CachePool(model.config, num_slots=4, num_pages=8, page_size=4, device="cpu", dtype=torch.float32)
    cache = BatchCache(pool, torch.tensor([1, 2]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([3, 6]),
                       mask_rows=True)
    explained = torch._dynamo.explain(decode_logits)(model, torch.tensor([[5], [7]]), cache)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_compile_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("K3_COMPILE_DECODE", raising=False)
    assert compile_decode_from_env() is False
    monkeypatch.setenv("K3_COMPILE_DECODE", "1")
    assert compile_decode_from_env() is True
    monkeypatch.setenv("K3_COMPILE_DECODE", "yes")
    with pytest.raises(ValueError, match="K3_COMPILE_DECODE"):
        compile_decode_from_env()


@pytest.mark.slow
@pytest.mark.parametrize("fuse_weights", [False, True])
def test_engine_with_compiled_decode_generates_the_same_tokens(model, monkeypatch, fuse_weights):
    """Also with the projection weights fused (what the engine runs on CUDA for frozen models)."""
    import copy

    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    prompts = [[3, 9, 4, 1, 7], [8, 2, 6]]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    expected = Engine(model, max_context=32, max_batch=2, prefix_cache=False).generate_ids(prompts, params)
    monkeypatch.setenv("K3_COMPILE_DECODE", "1")
    engine = Engine(copy.deepcopy(model), max_context=32, max_batch=2, prefix_cache=False, fuse_weights=fuse_weights)
    assert engine.runner.compile_decode
    got = engine.generate_ids(prompts, params)
    assert got == expected and all(len(t) == 6 for t in got)


@pytest.mark.slow
def test_bench_decode_compile_runs_on_cpu(model, monkeypatch):
    """bench/decode.py --compile's per-case measurement, on CPU (no graphs there: the same greedy loop)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    bench = importlib.import_module("decode")
    result = bench.bench_k3(model, model.config, batch=2, prompt=8, new=3, max_real=1 << 20,
                            device=torch.device("cpu"), compile=True)
    assert result["graph_step_ms"] > 0 and result["compiled_graph_step_ms"] > 0
    assert result["compiled_graph_vs_eager_max_abs_diff"] < 1e-4 and result["compiled_graph_vs_eager_rel_err"] < 1e-5
    assert result["graph_vs_eager_max_abs_diff"] == 0.0 and result["compiled_graph_vs_eager_argmax_agree"] == 1.0


def test_bench_decode_prefills_a_batch_in_chunks_equal_to_one_forward(model, monkeypatch):
    """bench/decode.py prefills batch x prompt in forwards of PREFILL_TOKEN_BUDGET tokens (64 x 8K at once ran out
    of memory on an 80 GB GPU): the last logits and the cache equal one forward's, for a batch."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    bench = importlib.import_module("decode")
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(bench, "PREFILL_TOKEN_BUDGET", 1 << 20)
    whole, whole_logits = bench.prefill(model, ids)
    monkeypatch.setattr(bench, "PREFILL_TOKEN_BUDGET", 3 * 6)  # chunks of 6, 6, 6 and 2 positions
    lengths = []
    hook = model.model.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    try:
        chunked, chunked_logits = bench.prefill(model, ids)
    finally:
        hook.remove()
    assert lengths == [6, 6, 6, 2]
    assert chunked.seen_tokens == whole.seen_tokens == 20
    torch.testing.assert_close(chunked_logits, whole_logits, rtol=1e-5, atol=1e-5)
    assert chunked.nbytes("kda") == whole.nbytes("kda") and chunked.nbytes("mla") == whole.nbytes("mla")


def test_engine_compiles_its_decode_forward_twice_for_every_batch_size_and_context(monkeypatch):
    """The engine's compiled decode forward with the runner's compile options: one graph for a batch of one, one
    for every larger batch, over growing contexts (page tables of 1, 2, 4 and 8 pages) and a second engine of
    another context length, where dynamo's automatic dynamic compiled four times or more. On the debug preset cut
    to two layers (KDA with the dense MLP, MLA with the MoE): dynamo's tracing is most of the time, and every
    kind of layer and cache is still in the graph."""
    import torch._dynamo.testing

    from k3.infer import runner as runner_module
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", num_layers=2, full_attn_layers=[2])).eval()
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()  # dynamo's tracing and guards alone, no code generation
    counted = torch.compile(runner_module.decode_logits, backend=counter, fullgraph=True)
    monkeypatch.setattr(runner_module, "compiled_decode_logits", lambda: counted)
    monkeypatch.setenv("K3_COMPILE_DECODE", "1")
    params = SamplingParams(max_new_tokens=5, temperature=0)
    for max_context in (64, 48):
        engine = Engine(model, max_context=max_context, max_batch=8, prefix_cache=False, page_size=4)
        assert engine.runner.compile_decode
        for rows, prompt in [(1, 2), (2, 3), (3, 9), (1, 20), (5, 30), (8, 4)]:
            prompts = [[(5 * r + j) % 50 + 3 for j in range(prompt + r)] for r in range(rows)]
            assert all(len(t) == 5 for t in engine.generate_ids(prompts, params))
    assert counter.frame_count == 2
