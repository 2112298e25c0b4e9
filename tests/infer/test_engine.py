"""The engine against the recompute-everything reference, on CPU in fp32: continuous batching, chunked
prefill, prefix caching, forks, sampling parameters, aborts and the pool's accounting."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine, greedy_without_cache
from k3.infer.sampling import SamplingParams, filter_logits, sample_next, sample_rows
from k3.model import K3ForCausalLM


class ByteTokenizer:
    """ids = bytes + 1, EOS = 0 (enough of the tokenizer interface for the engine)."""

    vocab_size, eos_token_id, bos_token_id = 256, 0, None

    def encode(self, text):
        return [b + 1 for b in text.encode("utf-8")][:255]

    def decode(self, ids):
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


def greedy(max_new_tokens, stop=(), **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop), **kw)


def random_prompts(seed, lengths):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=generator).tolist() for n in lengths]


def small_engine(model, **kw):
    args = dict(max_context=512, max_batch=8, page_size=16, prefill_chunk=32)
    args.update(kw)
    return Engine(model, ByteTokenizer(), **args)


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kda_slots_used"] == 0 and stats["mla_pages_used"] == 0
    # Everything not held by the prefix cache is back on the free lists.
    engine.clear_prefix_cache()
    assert engine.pool.free_slots == engine.pool.num_slots and engine.pool.free_pages == engine.pool.num_pages


def test_cached_greedy_equals_recomputing_without_cache(model):
    engine = small_engine(model)
    prompt = random_prompts(1, [77])[0]  # several prefill chunks, partial last page
    assert engine.generate_ids([prompt], greedy(40))[0] == greedy_without_cache(model, prompt, 40)
    assert_idle(engine)


def test_a_request_gives_the_same_logits_alone_and_in_a_busy_batch(model):
    """The same prompt alone, and joining a batch of others mid-flight (its prefill chunks mixed with their
    decodes), gives the same greedy tokens; logprobs agree to fp32 rounding (a CPU GEMM of 4 rows does not
    round like one of 1 row, so bitwise equality is not on offer; prefill chunking is the same by design)."""
    prompts = random_prompts(2, [5, 19, 19, 64, 5, 100, 33, 48])
    params = greedy(16, logprobs=3)
    alone = [small_engine(model, prefix_cache=False).complete([p], params)[0].outputs[0] for p in prompts]
    engine = small_engine(model, prefix_cache=False, max_batch=4, max_step_tokens=40)
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    for _ in range(5):
        engine.step()
    ids += [engine.add_request(p, params) for p in prompts[3:]]
    finished = engine.run_until_done(ids)
    for rid, reference in zip(ids, alone):
        seq = finished[rid][0]
        assert seq.generated == reference.token_ids
        assert seq.logprobs == pytest.approx(reference.logprobs, abs=1e-5, rel=0)
        assert [[t for t, _ in row] for row in seq.top_logprobs] == [[t for t, _ in row]
                                                                     for row in reference.top_logprobs]
    for reference, prompt in zip(alone, prompts):
        assert reference.token_ids == greedy_without_cache(model, prompt, 16)
    assert_idle(engine)


def test_prefix_cache_reuses_a_shared_prompt_exactly(model):
    system = random_prompts(3, [70])[0]
    users = random_prompts(4, [9, 30, 3])
    prompts = [system + u for u in users]
    engine = small_engine(model)
    outs = [engine.generate_ids([p], greedy(12))[0] for p in prompts]
    stats = engine.stats()
    # The second prompt diverges at page 4 (64 tokens) and saves a state there; the third reuses it.
    assert stats["prefix_cache_hits"] >= 1 and stats["prefix_cache_hit_tokens"] >= 64
    for prompt, out in zip(prompts, outs):
        assert out == greedy_without_cache(model, prompt, 12)
    # The same prompt again starts from its own last page boundary.
    before = engine.stats()["prefix_cache_hit_tokens"]
    assert engine.generate_ids([prompts[1]], greedy(12))[0] == outs[1]
    assert engine.stats()["prefix_cache_hit_tokens"] - before == (len(prompts[1]) - 1) // 16 * 16
    assert_idle(engine)


def test_multi_turn_continues_from_the_previous_turn(model):
    engine = small_engine(model)
    turn = random_prompts(5, [40])[0]
    reply = engine.generate_ids([turn], greedy(10))[0]
    second = turn + reply + random_prompts(6, [7])[0]
    before = engine.stats()["prefix_cache_hit_tokens"]
    assert engine.generate_ids([second], greedy(10))[0] == greedy_without_cache(model, second, 10)
    assert engine.stats()["prefix_cache_hit_tokens"] - before == 32


def test_n_samples_prefill_once_and_fork(model):
    prompt = random_prompts(7, [45])[0]
    engine = small_engine(model)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, n=4, logprobs=0)
    out = engine.complete([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert engine.stats()["prompt_tokens"] == 45  # prefilled once
    # Each sample equals a single request seeded as that sample (seed + index), run alone.
    for c in out.outputs:
        alone = small_engine(model, prefix_cache=False).complete(
            [prompt], SamplingParams(max_new_tokens=10, temperature=1.0, seed=11 + c.index, logprobs=0))[0]
        assert c.token_ids == alone.outputs[0].token_ids
        assert c.logprobs == pytest.approx(alone.outputs[0].logprobs, abs=1e-5, rel=0)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Greedy forks are all the reference continuation.
    greedy_out = engine.complete([prompt], greedy(8, n=3))[0]
    reference = greedy_without_cache(model, prompt, 8)
    assert all(c.token_ids == reference for c in greedy_out.outputs)
    assert_idle(engine)


def test_logprobs_are_the_models_own_at_the_sampling_temperature(model):
    """A sampled token's logprob is that of the distribution it was drawn from, softmax(logits / T); scoring
    (no sampling) gives the model's own, temperature 1. Top-k ids agree: dividing by T keeps the order."""
    prompt = random_prompts(8, [20])[0]
    engine = small_engine(model)
    c = engine.complete([prompt], SamplingParams(max_new_tokens=6, temperature=0.7, seed=3, logprobs=2))[0].outputs[0]
    scored = engine.score([prompt + c.token_ids], [len(prompt)], top_k=2)[0]
    for mine, theirs in zip(c.top_logprobs, scored.top_logprobs):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
    logits = model(torch.tensor([prompt + c.token_ids])).logits[0].detach()
    rows = [(len(prompt) - 1 + i, t) for i, t in enumerate(c.token_ids)]
    at_t = logits.div(0.7).log_softmax(-1)
    assert c.logprobs == pytest.approx([float(at_t[r, t]) for r, t in rows], abs=1e-4)
    at_1 = logits.log_softmax(-1)
    assert scored.logprobs == pytest.approx([float(at_1[r, t]) for r, t in rows], abs=1e-4)


def test_sampled_logprobs_at_temperature_equal_a_hand_computation():
    # logits (2, 0, -1) at T = 0.5 -> (4, 0, -2): log p = z - log(e^4 + e^0 + e^-2) = z - 4.0205811
    logits = torch.tensor([[2.0, 0.0, -1.0], [2.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.5, top_k=1, logprobs=0), SamplingParams(temperature=0, logprobs=0)]
    out = sample_rows(logits, params, [None, None], want_logprobs=True, top_n=3)
    assert out.tokens.tolist() == [0, 0]
    assert out.logprobs[0].item() == pytest.approx(4 - 4.0205811, abs=1e-6)
    assert out.top_logprobs[0].tolist() == pytest.approx([-0.0205811, -4.0205811, -6.0205811], abs=1e-6)
    # the greedy row (temperature 0) reports the model's own: log(e^2 / (e^2 + 1 + e^-1)) = -0.1698460
    assert out.logprobs[1].item() == pytest.approx(-0.1698460, abs=1e-6)


def test_score_packs_sequences_without_leaking(model):
    engine = small_engine(model)
    seqs = random_prompts(9, [12, 30, 7])
    packed = engine.score(seqs, [1, 5, 3], max_tokens_per_forward=64)
    for seq, start, out in zip(seqs, [1, 5, 3], packed):
        logits = model(torch.tensor([seq])).logits[0].log_softmax(-1)
        assert out.logprobs == pytest.approx([float(logits[t - 1, seq[t]]) for t in range(start, len(seq))],
                                             abs=1e-4)
    with pytest.raises(ValueError, match="starts"):
        engine.score([[1, 2]], [0])


def test_score_longer_than_a_forward_runs_in_cached_chunks(model):
    """A sequence over the per-forward budget is fed in chunks through the recurrent cache (how k3 eval scores
    1M tokens): the same log-probs and top-k as one whole forward, with chunk edges inside the scored span and
    before its start."""
    engine = small_engine(model)
    seqs = random_prompts(21, [61, 40, 9])
    starts = [1, 23, 4]
    whole = engine.score(seqs, starts, top_k=2, max_tokens_per_forward=128)
    chunked = engine.score(seqs, starts, top_k=2, max_tokens_per_forward=16)  # 61 and 40 chunked, 9 packed
    for seq, start, a, b in zip(seqs, starts, whole, chunked):
        assert len(b.logprobs) == len(seq) - start
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [[t for t, _ in row] for row in b.top_logprobs] == [[t for t, _ in row] for row in a.top_logprobs]


def test_stop_tokens_strings_and_lengths(model):
    engine = small_engine(model)
    prompts = [[3, 4, 5], [9, 8, 7]]
    free = engine.generate_ids(prompts, greedy(10))
    stop = free[0][2]
    stopped = engine.generate_ids(prompts, greedy(10, stop=[stop]))
    assert stopped[0] == free[0][:free[0].index(stop) + 1]
    cut = free[1].index(stop) + 1 if stop in free[1] else len(free[1])
    assert stopped[1] == free[1][:cut]
    text = ByteTokenizer().decode(free[0])
    start = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    needle = text[start:start + 2]
    out = engine.complete([prompts[0]], SamplingParams(max_new_tokens=10, temperature=0, stop=[needle]))[0].outputs[0]
    assert out.finish_reason == "stop" and needle not in out.text and text.startswith(out.text)
    assert engine.complete([prompts[0]], greedy(4))[0].outputs[0].finish_reason == "length"
    assert_idle(engine)


class CountingAsciiTokenizer:
    """Token i is one printable character; remembers the longest list of ids it was asked to decode."""

    vocab_size, eos_token_id, bos_token_id = 256, None, None

    def __init__(self):
        self.longest = 0

    def encode(self, text):
        return [ord(c) - 33 for c in text]

    def decode(self, ids):
        self.longest = max(self.longest, len(ids))
        return "".join(chr(33 + i % 90) for i in ids)


def test_stop_strings_are_checked_on_the_new_text_only(model):
    """The stop-string check decodes a window of a token or two per step, never the whole output (which made
    long outputs quadratic), and stops at the first token whose text completes a stop string."""
    tokenizer = CountingAsciiTokenizer()
    engine = Engine(model, tokenizer, max_context=512, max_batch=8, page_size=16, prefill_chunk=32)
    prompt = [3, 4, 5]
    free = engine.generate_ids([prompt], greedy(60))[0]
    text = tokenizer.decode(free)
    needle = text[40:43]
    first = text.index(needle)  # one character per token: the stop completes at token first + 3
    tokenizer.longest = 0
    stopped = engine.generate_ids([prompt], SamplingParams(max_new_tokens=60, temperature=0, stop=[needle]))[0]
    assert stopped == free[:first + len(needle)]
    assert tokenizer.longest <= 2
    assert_idle(engine)


def test_bad_prompts_are_refused_with_the_reason(model):
    engine = small_engine(model, max_context=16)
    with pytest.raises(ValueError, match="prompt 1 has 16 tokens but the context allows 16"):
        engine.generate_ids([[1, 2], list(range(1, 17))], greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate_ids([[]], greedy(4))
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        engine.generate_ids([[1, 999]], greedy(4))
    assert len(engine.generate_ids([list(range(1, 11))], greedy(50))[0]) == 6  # stops at the context
    assert_idle(engine)


def test_abort_frees_the_slot_and_pages_at_once(model):
    engine = small_engine(model, max_batch=2)
    a = engine.add_request(random_prompts(10, [50])[0], greedy(100))
    b = engine.add_request(random_prompts(11, [20])[0], greedy(100))
    c = engine.add_request([1, 2, 3], greedy(5))  # waits: the batch is full
    for _ in range(4):
        engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
    assert engine.abort(a) and not engine.abort(a)
    assert engine.stats()["running"] == 1
    engine.abort(c)
    engine.run_until_done([b])
    assert_idle(engine)


def test_admission_waits_for_pages(model):
    # Room for two full requests only: the third waits in the queue, then runs when one finishes.
    engine = small_engine(model, max_batch=4, num_pages=8, prefix_cache=False, max_context=64)
    prompts = random_prompts(12, [40, 40, 40])
    ids = [engine.add_request(p, greedy(20)) for p in prompts]
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
    done = engine.run_until_done(ids)
    for rid, prompt in zip(ids, prompts):
        assert done[rid][0].generated == greedy_without_cache(model, prompt, 20)
    with pytest.raises(ValueError, match="MLA pages"):
        engine.add_request([1] * 10, SamplingParams(max_new_tokens=50, n=4))


def test_pool_memory_is_constant_for_kda_and_paged_for_mla(model):
    engine = small_engine(model)
    short, long = engine.pool.bytes_per_request(64), engine.pool.bytes_per_request(4096)
    assert short["kda"] == long["kda"] > 0
    assert long["mla"] == 64 * short["mla"]


def test_sampling_parameters_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 4)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=0)]
    draws = [set() for _ in params]
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        for row, token in enumerate(sample_rows(logits, params, [generator] * 4).tokens.tolist()):
            draws[row].add(token)
    # min_p 0.3: keeps p >= 0.3 * 0.64, i.e. tokens 0 and 1 (0.24 >= 0.19), not 2 (0.09).
    assert draws == [{0, 1}, {0}, {0, 1}, {0}]
    # penalties: token 0 was generated; a big presence penalty moves greedy to token 1.
    counts = torch.zeros(5, dtype=torch.long)
    counts[0] = 1
    penalised = SamplingParams(temperature=0, presence_penalty=2.0)
    assert sample_rows(logits[:1], [penalised], [None], [(None, counts)]).tokens.tolist() == [1]
    repeat = SamplingParams(temperature=0, repetition_penalty=2.0)  # 4 / 2 = 2 < 3
    assert sample_rows(logits[:1], [repeat], [None], [(counts, torch.zeros(5, dtype=torch.long))]).tokens.tolist() == [1]


def test_seeded_sampling_is_reproducible(model):
    engine = small_engine(model)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=5)
    a = engine.generate(["hello", "hi"], params)
    b = engine.generate(["hello", "hi"], params)
    assert a == b and all(isinstance(t, str) for t in a)


def test_filters_keep_the_right_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, ...
    kept = torch.isfinite(filter_logits(logits, top_p=0.8))[0].tolist()
    assert kept == [True, True, False, False, False] and probs[0] < 0.8 <= probs[:2].sum()
    assert torch.isfinite(filter_logits(logits, top_p=0.5))[0].tolist() == [True, False, False, False, False]
    generator = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, SamplingParams(temperature=1.0, top_k=2), generator)) for _ in range(50)}
    assert draws == {0, 1}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_recorded_routing_is_what_a_full_forward_routes(model):
    """record_routing: every fed token's experts per MoE layer, across chunked prefill, batched decode and
    forks, equal to the experts a plain forward over the whole sequence picks (the trainer's view)."""
    from k3.rl.routing import RoutingReplay

    engine = small_engine(model, record_routing=True)
    prompts = random_prompts(13, [40, 23])
    outs = engine.complete(prompts, greedy(9, n=2))
    replay = RoutingReplay(model)
    for prompt, out in zip(prompts, outs):
        for completion in out.outputs:
            fed = prompt + completion.token_ids[:-1]
            with replay.record() as routes, torch.no_grad():
                model(torch.tensor([fed]))
            expected = torch.stack([calls[0] for calls in routes])  # [layers, tokens, K]
            assert completion.routing.shape == expected.shape
            # Expert choice is a set: compare sorted ids per token.
            assert torch.equal(completion.routing.sort(-1).values, expected.sort(-1).values)
    assert_idle(engine)


def test_score_in_head_chunks_equals_one_chunk(model):
    engine = small_engine(model)
    seqs = random_prompts(14, [50, 9])
    whole = engine.score(seqs, [1, 2], top_k=2)
    results = [None, None]
    engine._score_packed(seqs, [1, 2], [0, 1], 2, results, head_rows=7)
    for a, b in zip(whole, results):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        assert [[t for t, _ in row] for row in a.top_logprobs] == [[t for t, _ in row] for row in b.top_logprobs]


def test_default_prefill_chunk_grows_with_a_long_context(model):
    """Beyond 32K of context the default chunk is a sixteenth of it (k3.infer.engine.long_prefill_chunk), so a
    long prompt is not prefilled in hundreds of short chunks that each re-read the whole MLA cache."""
    assert Engine(model, max_context=4096, max_batch=1).scheduler.prefill_chunk == 512  # CPU's short default
    assert Engine(model, max_context=65536, max_batch=1, prefix_cache=False).scheduler.prefill_chunk == 4096
    assert Engine(model, max_context=65536, max_batch=1, prefill_chunk=256).scheduler.prefill_chunk == 256


def test_default_chunks_and_step_budgets(model):
    """On a GPU the short chunk is 8,192 tokens (prefill there is launch-bound) while a step keeps the 8,192
    prefill tokens it took before; long contexts keep four of their chunks a step; elsewhere nothing moved."""
    from k3.infer.engine import default_prefill_chunk

    assert default_prefill_chunk(4096, on_gpu=False) == (512, 2048)
    assert default_prefill_chunk(4096, on_gpu=True) == (8192, 16384)
    assert default_prefill_chunk(65536, on_gpu=False) == (4096, 16384)
    assert default_prefill_chunk(65536, on_gpu=True) == (8192, 16384)  # the long chunk (4,096) is shorter
    assert default_prefill_chunk(1 << 20, on_gpu=True) == (65536, 262144)
    engine = Engine(model, max_context=4096, max_batch=3)
    assert (engine.scheduler.prefill_chunk, engine.scheduler.max_step_tokens, engine.batch_tokens) == (512, 2051, 2048)
    engine = Engine(model, max_context=4096, max_batch=3, prefill_chunk=256)
    assert (engine.scheduler.max_step_tokens, engine.batch_tokens) == (1027, 1024)
