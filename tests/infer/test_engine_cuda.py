"""The engine's CUDA paths against its PyTorch twin (runs only where CUDA is available)."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM
from prefill_spy import spy_prefills

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def tiny_bf16_model():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(ModelConfig.from_preset("tiny"))
    return model.to(torch.bfloat16).eval()


def test_cuda_graph_decode_equals_the_eager_step():
    """bf16 on one GPU: CUDA-graph decode and the eager step give the same greedy tokens, with logprobs within
    2e-2 (the graph replays the same kernels; differences come only from kernel choice at other shapes)."""
    model = tiny_bf16_model()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=generator).tolist()
               for n in (7, 33, 64, 100, 250)]
    params = SamplingParams(max_new_tokens=24, temperature=0, logprobs=0)
    eager = Engine(model, None, max_context=512, max_batch=8, use_cuda_graphs=False).complete(prompts, params)
    graph_engine = Engine(model, None, max_context=512, max_batch=8)
    graph = graph_engine.complete(prompts, params)
    assert graph_engine.runner.graphs, "no CUDA graph was captured"
    for a, b in zip(eager, graph):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 2e-2


def test_padded_prefill_equals_prefilling_each_length_apart():
    """bf16 on one GPU (fla's chunked and recurrent KDA kernels): prompts of different lengths prefilled in one
    right-padded forward leave the first KDA layer's states within 2e-2 (relative) of prefill forwards that pad
    nothing (prefill_padding=0): a NaN, a write or a decay from the padded tokens would show there, where the
    layer reads only the embeddings. Deeper layers see the mixers' and experts' outputs of a different batch shape
    (other GEMM kernels, bf16 rounding, routing flips in a random-init MoE), so they are checked finite, and the
    first greedy tokens equal up to bf16 near-ties (assert_same_greedy_token)."""
    model = tiny_bf16_model()
    generator = torch.Generator().manual_seed(2)
    # 11-14 tokens: the recurrent kernel (in place, up to RECURRENT_MAX_TOKENS); 200-230: fla's chunked kernel.
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=generator).tolist()
               for n in (14, 12, 11, 230, 215, 200)]
    results = {}
    for padding in (0.25, 0.0):
        engine = Engine(model, None, max_context=512, max_batch=8, prefix_cache=False, prefill_padding=padding)
        calls = []
        spy_prefills(engine, lambda start, end: calls.append(end))
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=32, temperature=0, logprobs=2)) for p in prompts]
        engine.step()
        seqs = [engine.requests[rid].sequences[0] for rid in ids]
        states = torch.stack([engine.pool.kda_state[:, s.slot] for s in seqs]).float()  # [rows, layers, ...]
        firsts = [(s.generated[0], s.logprobs[0], s.top_logprobs[0]) for s in seqs]
        results[padding] = (calls, states, firsts)
    assert any(isinstance(end, list) and len(set(end)) > 1 for end in results[0.25][0]), "nothing was padded"
    assert all(isinstance(end, int) or len(set(end)) == 1 for end in results[0.0][0])
    padded, apart = results[0.25], results[0.0]
    assert torch.isfinite(padded[1]).all()
    per_layer = [((padded[1][:, layer] - apart[1][:, layer]).abs().amax()
                  / apart[1][:, layer].abs().amax().clamp_min(1e-3)).item() for layer in range(padded[1].shape[1])]
    assert per_layer[0] < 2e-2, f"first KDA layer's states apart by {per_layer[0]:.4f} (every layer: {per_layer})"
    for row, (got, want) in enumerate(zip(padded[2], apart[2])):
        assert_same_greedy_token(got, want, 2e-2, f"prompt {row} (every layer's state difference: {per_layer})")


def test_prompt_tails_from_different_positions_share_a_forward_on_the_gpu():
    """bf16 on one GPU, prefix cache on: first turns save their states at their last page boundary on the way
    (StateSnapshot), then their next turns hit those states and prefill their tails (different positions, a few
    tokens each) in one forward, each row attending from its own position. First greedy tokens equal, and
    logprobs within 2e-2 of, an engine that pads nothing and caches no prefix."""
    model = tiny_bf16_model()
    generator = torch.Generator().manual_seed(3)
    firsts_turns = [torch.randint(1, model.config.vocab_size, (n,), generator=generator).tolist()
                    for n in (100, 90, 75, 70, 45, 40)]
    prompts = [turn + torch.randint(1, model.config.vocab_size, (extra,), generator=generator).tolist()
               for turn, extra in zip(firsts_turns, (5, 9, 12, 3, 7, 2))]
    params = SamplingParams(max_new_tokens=4, temperature=0, logprobs=2)
    firsts = {}
    for name, options in (("ragged", {}), ("apart", {"prefix_cache": False, "prefill_padding": 0.0})):
        engine = Engine(model, None, max_context=512, max_batch=8, page_size=16, **options)
        engine.complete(firsts_turns, SamplingParams(max_new_tokens=1, temperature=0))
        calls = []
        spy_prefills(engine, lambda start, end: calls.append(start))
        outs = engine.complete(prompts, params)
        firsts[name] = [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0], o.outputs[0].top_logprobs[0])
                        for o in outs]
        if name == "ragged":
            assert engine.prefix_cache.hits == len(prompts)
            assert any(isinstance(s, list) and len(set(s)) > 1 for s in calls), f"no ragged forward: {calls}"
    for row, (got, want) in enumerate(zip(firsts["ragged"], firsts["apart"])):
        assert_same_greedy_token(got, want, 2e-2, f"prompt {row}")


def assert_same_greedy_token(got, want, tol, where):
    """(token, logprob, top-2 [(token, logprob)]) of one greedy step against the reference's: the same token with
    logprobs within tol, or, where bf16 rounding picked the other of two near-tied tokens, the two runs' top two
    are the same pair, the reference's gap within tol and each token's logprob within tol of the other run's."""
    (token, logprob, top), (token_ref, logprob_ref, top_ref) = got, want
    detail = f"{where}: got {token} ({logprob:.4f}; top {top}), reference {token_ref} ({logprob_ref:.4f}; top {top_ref})"
    assert abs(logprob - logprob_ref) < tol, detail
    if token != token_ref:
        mine, theirs = dict(top), dict(top_ref)
        assert set(mine) == set(theirs) == {token, token_ref}, detail
        assert top_ref[0][1] - top_ref[1][1] < tol, detail
        assert all(abs(mine[t] - theirs[t]) < tol for t in mine), detail


def test_overlapped_steps_equal_plain_steps_on_the_gpu():
    """bf16 with CUDA-graph decode: steps launched before the previous step's tokens are read (overlap_steps: the
    rows' inputs copied on the device into the graph's buffer, the tokens read back through pinned copies) give
    the plain steps' greedy tokens, with logprobs within 2e-2, and leave the pool empty."""
    model = tiny_bf16_model()
    generator = torch.Generator().manual_seed(4)
    # Prompts of one length and no prefix cache: one prefill shape, so that the test compiles few kernels (with
    # five lengths and the cache's state snapshots it was still compiling after 170 s on a cold kernel cache).
    prompts = [torch.randint(1, model.config.vocab_size, (64,), generator=generator).tolist() for _ in range(5)]
    params = [SamplingParams(max_new_tokens=n, temperature=0, logprobs=0) for n in (5, 12, 20, 31, 40)]
    plain = Engine(model, None, max_context=512, max_batch=8, prefix_cache=False,
                   overlap_steps=False).complete(prompts, params)
    engine = Engine(model, None, max_context=512, max_batch=8, prefix_cache=False)  # overlapped: graphs' default
    assert engine.overlap_steps
    overlapped = engine.complete(prompts, params)
    assert engine.runner.graphs, "no CUDA graph was captured"
    for a, b in zip(plain, overlapped):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 2e-2
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["kda_slots_used"] == 0 and engine.stats()["mla_pages_used"] == 0
