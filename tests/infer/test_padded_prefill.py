"""Prefill chunks of different lengths from one position share a forward, right-padded to the longest
(k3.infer.scheduler.prefill_forwards, k3.infer.runner.ModelRunner.prefill): every cache must end as the row's own
prefill leaves it, and the grouping must respect the padding, token and page limits. CPU, fp32."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine, greedy_without_cache
from k3.infer.sampling import SamplingParams
from k3.infer.scheduler import Sequence, prefill_forwards
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


def prompts_of(lengths, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=generator).tolist() for n in lengths]


def engine_for(model, fuse_weights, **kw):
    return Engine(model, None, max_context=256, max_batch=8, page_size=16, prefill_chunk=64, prefix_cache=False,
                  fuse_weights=fuse_weights, **kw)


def spy_prefills(engine):
    """Record each prefill forward as the runner gets it: (start, ends) for rows from one position, else
    (starts, ends)."""
    calls = []
    real = engine.runner.prefill

    def prefill(seqs, start, end, *snapshots):
        starts = [start] * len(seqs) if isinstance(start, int) else list(start)
        ends = [end] * len(seqs) if isinstance(end, int) else list(end)
        calls.append((starts[0] if len(set(starts)) == 1 else starts, ends))
        return real(seqs, start, end, *snapshots)

    engine.runner.prefill = prefill
    return calls


def caches_of(engine, seq, tokens):
    """The row's KDA states and conv tails, and its MLA latents and rope keys for its first `tokens` tokens."""
    pool, size = engine.pool, engine.pool.page_size
    positions = torch.arange(tokens)
    flat = torch.tensor(seq.pages)[positions // size] * size + positions % size
    kda = [(pool.kda_state[n, seq.slot].clone(), pool.kda_tails[n, seq.slot].clone())
           for n in range(pool.kda_state.shape[0])]
    mla = [(pool.latent[n].view(-1, pool.latent.shape[-1])[flat].clone(),
            pool.k_rope[n].view(-1, pool.k_rope.shape[-1])[flat].clone()) for n in range(pool.latent.shape[0])]
    return kda, mla


def assert_caches_close(got, want):
    for (state, tails), (state_ref, tails_ref) in zip(got[0], want[0]):
        torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tails, tails_ref, atol=1e-6, rtol=1e-6)
    for (latent, rope), (latent_ref, rope_ref) in zip(got[1], want[1]):
        torch.testing.assert_close(latent, latent_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rope, rope_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fuse_weights", [False, True], ids=["separate-projections", "fused-weights"])
def test_a_padded_prefill_leaves_each_cache_as_its_own_prefill(model, fuse_weights):
    """Four prompts of 100, 96, 93 and 90 tokens: the first chunks (64 each) share one forward, the second chunks
    (36, 32, 29, 26 tokens from position 64) one padded forward; every row's states, tails and latents then equal
    those of the prompt prefilled alone, and so do its logits and greedy tokens."""
    prompts = prompts_of([100, 96, 93, 90])
    params = SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=3)  # pages to reach 100 for each
    engine = engine_for(model, fuse_weights)
    calls = spy_prefills(engine)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.step()  # both prefill steps; the last one samples each row's first token
    assert calls == [(0, [64, 64, 64, 64]), (64, [100, 96, 93, 90])]
    assert engine.stats()["prefill_forwards"] == 2 and engine.stats()["steps"] == 2  # four prompts, two forwards
    seqs = [engine.requests[rid].sequences[0] for rid in ids]
    together = [caches_of(engine, seq, len(p)) for seq, p in zip(seqs, prompts)]
    firsts = [seq.generated[0] for seq in seqs]
    first_logprobs = [seq.logprobs[0] for seq in seqs]
    for prompt, got, first, logprob in zip(prompts, together, firsts, first_logprobs):
        alone = engine_for(model, fuse_weights)
        rid = alone.add_request(prompt, params)
        alone.step()
        alone.step()
        seq = alone.requests[rid].sequences[0]
        assert_caches_close(got, caches_of(alone, seq, len(prompt)))
        assert first == seq.generated[0]
        assert logprob == pytest.approx(seq.logprobs[0], abs=1e-5)


def test_padded_rows_decode_on_as_if_alone(model):
    """After a padded prefill the rows decode greedy tokens equal to recomputing without any cache (the padding's
    latents, written past each row's end, are overwritten before anything reads them)."""
    prompts = prompts_of([37, 33, 30, 31], seed=8)
    engine = engine_for(model, None)
    calls = spy_prefills(engine)
    outs = engine.generate_ids(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert (0, [37, 33, 31, 30]) in calls  # one forward, longest first
    for prompt, out in zip(prompts, outs):
        assert out == greedy_without_cache(model, prompt, 12)


def prefilled(engine, request_id, prompt):
    seqs = engine.requests[request_id].sequences
    return bool(seqs) and seqs[0].num_cached >= len(prompt)


def test_tails_after_prefix_hits_share_one_forward_as_if_alone(model):
    """Prompts that continue earlier ones (a multi-turn episode's next turn) hit the prefix cache where the earlier
    prompt saved its state (its last page boundary, saved on the way by the forward running through it), so each
    prefills a short tail from its own position. Tails from different positions share one forward, each row
    attending from its own position: every cache then equals the prompt's alone, and greedy decoding equals
    recomputing."""
    firsts = prompts_of([100, 90, 75, 70], seed=11)
    engine = Engine(model, None, max_context=256, max_batch=8, page_size=16, prefill_chunk=64)
    engine.generate_ids(firsts, SamplingParams(max_new_tokens=1, temperature=0.0))
    prompts = [first + more for first, more in zip(firsts, prompts_of([5, 9, 12, 3], seed=12))]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=3)
    calls = spy_prefills(engine)
    ids = [engine.add_request(p, params) for p in prompts]
    together = {}  # each row's caches as its prefill ends (rows that end early decode on in later steps)
    while len(together) < len(ids):
        engine.step()
        for rid, prompt in zip(ids, prompts):
            if rid not in together and prefilled(engine, rid, prompt):
                seq = engine.requests[rid].sequences[0]
                together[rid] = (caches_of(engine, seq, len(prompt)), seq.logprobs[0])
    assert engine.prefix_cache.hits == 4
    (starts, ends), = calls  # one forward from four positions
    assert sorted(zip(starts, ends)) == [(64, 73), (64, 87), (80, 99), (96, 105)]
    for prompt, rid in zip(prompts, ids):
        alone = Engine(model, None, max_context=256, max_batch=8, page_size=16, prefill_chunk=64,
                       prefix_cache=False)
        alone_id = alone.add_request(prompt, params)
        while not prefilled(alone, alone_id, prompt):
            alone.step()
        reference = alone.requests[alone_id].sequences[0]
        assert_caches_close(together[rid][0], caches_of(alone, reference, len(prompt)))
        assert together[rid][1] == pytest.approx(reference.logprobs[0], abs=1e-5)
    outs = engine.run_until_done(ids)
    for prompt, rid in zip(prompts, ids):
        assert outs[rid][0].generated == greedy_without_cache(model, prompt, 16)


def test_a_forward_runs_through_a_prefix_boundary_and_saves_the_state_there(model):
    """A prompt's last page boundary (96 of 100 tokens) lies inside its second chunk [64, 100): the chunk is not
    cut there (one forward instead of two), and the prefix-cache entry at 96 holds the KDA states and conv tails
    of the prompt's first 96 tokens prefilled alone."""
    prompt = prompts_of([100], seed=13)[0]
    engine = Engine(model, None, max_context=256, max_batch=8, page_size=16, prefill_chunk=64)
    calls = spy_prefills(engine)
    engine.generate_ids([prompt], SamplingParams(max_new_tokens=1, temperature=0.0))
    assert calls == [(0, [64]), (64, [100])]
    (entry,) = engine.prefix_cache.entries.values()
    assert entry.boundary == 96
    alone = Engine(model, None, max_context=256, max_batch=8, page_size=16, prefill_chunk=64, prefix_cache=False)
    alone_id = alone.add_request(prompt[:96], SamplingParams(max_new_tokens=2, temperature=0.0))
    while not prefilled(alone, alone_id, prompt[:96]):
        alone.step()
    slot = alone.requests[alone_id].sequences[0].slot
    torch.testing.assert_close(engine.pool.kda_state[:, entry.slot], alone.pool.kda_state[:, slot], atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(engine.pool.kda_tails[:, entry.slot], alone.pool.kda_tails[:, slot], atol=1e-6,
                               rtol=1e-6)
    assert not torch.equal(engine.pool.kda_state[:, entry.slot], alone.pool.kda_state[:, 0])  # not the scratch


def fake(pages, embeds=False):
    seq = Sequence("r", 0, SamplingParams(), [1] * 10, 10)
    seq.pages = list(range(pages))
    seq.prompt_embeds = torch.zeros(10, 4) if embeds else None
    return seq


def test_prefill_forwards_groups_within_the_padding_token_and_page_limits():
    a, b, c, d = fake(8), fake(8), fake(8), fake(8)
    forwards = prefill_forwards([(a, 0, 100), (b, 0, 90), (c, 0, 80)], page_size=16, max_tokens=1000)
    assert [(f.seqs, f.starts, f.ends) for f in forwards] == [([a, b, c], [0, 0, 0], [100, 90, 80])]
    # 100 + 40: padding 60 of 200 tokens is over a quarter, so the short one runs apart.
    forwards = prefill_forwards([(a, 0, 100), (b, 0, 40)], page_size=16, max_tokens=1000)
    assert [f.ends for f in forwards] == [[100], [40]]
    # Another start, or too many tokens for one forward, splits.
    forwards = prefill_forwards([(a, 0, 100), (b, 64, 100), (c, 0, 96), (d, 0, 95)], page_size=16, max_tokens=250)
    assert [(f.starts, f.ends) for f in forwards] == [([0, 0], [100, 96]), ([0], [95]), ([64], [100])]
    # A row whose pages stop before the longest end is not padded into it.
    short = fake(5)  # 80 tokens of pages
    forwards = prefill_forwards([(a, 0, 100), (short, 0, 80)], page_size=16, max_tokens=1000)
    assert [f.ends for f in forwards] == [[100], [80]]
    # Rows with image embeddings share only an exact (start, end).
    e, f, g = fake(8, True), fake(8, True), fake(8, True)
    forwards = prefill_forwards([(e, 0, 100), (f, 0, 100), (g, 0, 90)], page_size=16, max_tokens=1000)
    assert [(x.seqs, x.ends) for x in forwards] == [([e, f], [100, 100]), ([g], [90])]
    # Short chunks share a forward from any position (at most RAGGED_MAX_TOKENS, within RAGGED_MAX_CONTEXT).
    far = fake(600)
    forwards = prefill_forwards([(a, 96, 100), (b, 80, 90), (c, 64, 75), (far, 9000, 9010)], page_size=16,
                                max_tokens=1000)
    assert [([id(q) for q in x.seqs], x.starts, x.ends) for x in forwards] == [
        ([id(far)], [9000], [9010]), ([id(c), id(b), id(a)], [64, 80, 96], [75, 90, 100])]
    # prefill_padding 0: only equal chunks share a forward.
    forwards = prefill_forwards([(a, 0, 100), (b, 0, 99), (c, 0, 100)], page_size=16, max_tokens=1000,
                                max_padding=0.0)
    assert [(x.seqs, x.ends) for x in forwards] == [([a, c], [100, 100]), ([b], [99])]
