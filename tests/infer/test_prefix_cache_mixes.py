"""The prefix cache under mixed traffic, against recomputing (fp32, CPU): prompts that share prefixes of random
lengths with each other, several in flight at once, next turns of earlier prompts, chunk sizes that put the
prompts' page boundaries inside chunks (the forward saves the state there on its way) or on chunk ends, and
prefix caches of one to eight entries (evictions mid-traffic). Every greedy continuation equals the model's
without any cache, and the pool is whole afterwards."""

import random

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine, greedy_without_cache
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM

EOS = 0


class ByteTokenizer:
    vocab_size, eos_token_id, bos_token_id = 256, EOS, None


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


def ids(generator, length):
    return torch.randint(1, 256, (length,), generator=generator).tolist()


def reference(model, prompt, new):
    out = greedy_without_cache(model, prompt, new)
    return out[: out.index(EOS) + 1] if EOS in out else out  # the engine stops at EOS


@pytest.mark.parametrize("seed", range(6))
def test_greedy_outputs_under_mixed_prefix_traffic_equal_recomputing(model, seed):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    engine = Engine(model, ByteTokenizer(), max_context=384, max_batch=rng.choice([2, 4, 8]), page_size=16,
                    prefill_chunk=rng.choice([32, 48, 64, 128]), prefix_slots=rng.choice([1, 2, 8]))
    bases = [ids(generator, rng.randint(20, 150)) for _ in range(3)]
    prompts = []
    for _ in range(10):
        base = rng.choice(bases)
        prompts.append(base[: rng.randint(1, len(base))] + ids(generator, rng.randint(0, 40)))
    turns = [prompt + [7, 8, 9] for prompt in prompts[:4]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    for batch in (prompts[:5], prompts[5:], turns):
        for prompt, out in zip(batch, engine.generate_ids(batch, greedy)):
            assert out == reference(model, prompt, 6), (seed, len(prompt))
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kda_slots_used"] == stats["mla_pages_used"] == 0
    engine.clear_prefix_cache()
    assert engine.pool.free_slots == engine.pool.num_slots and engine.pool.free_pages == engine.pool.num_pages


def test_a_reused_prefix_outlives_one_off_prompts_when_the_cache_is_full():
    """Eviction takes the least recently used entry that no lookup reused before any reused one: a system prompt's
    entry survives a burst of new prompts' own entries (plain LRU evicted it whenever more new prompts came than
    the cache held)."""
    from k3.infer.cache_pool import CachePool
    from k3.infer.prefix_cache import PrefixCache

    config = ModelConfig.from_preset("debug")
    pool = CachePool(config, num_slots=6, num_pages=40, page_size=4, device="cpu", dtype=torch.float32)
    cache = PrefixCache(pool, max_entries=3)
    source = pool.allocate_slot()
    generator = torch.Generator().manual_seed(0)
    system = ids(generator, 8)

    def save(tokens):
        pages = pool.allocate_pages(len(tokens) // 4)
        assert cache.insert(tokens, len(tokens), pages, source)
        for page in pages:  # the request's own references go; the cache keeps its own
            if pool.release_page(page):
                pool.return_page(page)

    save(system)
    hit, _ = cache.lookup(system + [1, 2, 3])
    assert hit is not None and hit.boundary == 8
    for _ in range(5):  # one-off prompts, more than the cache holds
        save(ids(generator, 12))
    hit, _ = cache.lookup(system + [4, 5, 6])
    assert hit is not None and hit.boundary == 8
    assert len(cache) == 3
    # Reused entries hold at most half the cache: a second reused prompt (2 of 3) makes the least recently used
    # reused one (the system prompt, untouched since) the next to go.
    other = ids(generator, 12)
    save(other)
    assert cache.lookup(other + [7])[0] is not None
    save(ids(generator, 12))
    assert cache.lookup(system + [8, 9])[0] is None and cache.lookup(other + [7])[0] is not None
    cache.clear()
    pool.free_slot(source)
    assert pool.free_slots == pool.num_slots and pool.free_pages == pool.num_pages


def test_a_shared_prefix_saved_where_prompts_diverge_outlives_one_off_prompts(model):
    """The state saved where a prompt leaves an earlier one's pages exists because two prompts share that prefix:
    it counts as reused from the start, so one-off prompts' entries go before it even in a cache of two entries,
    and a third prompt with the prefix hits it."""
    generator = torch.Generator().manual_seed(3)
    system = ids(generator, 40)  # pages of 16: the prompts diverge at 32
    engine = Engine(model, ByteTokenizer(), max_context=256, max_batch=2, page_size=16, prefill_chunk=64,
                    prefix_slots=2)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    for prompt in (system + ids(generator, 9), system + ids(generator, 11)):  # the second saves the state at 32
        engine.generate_ids([prompt], greedy)
    for _ in range(3):
        engine.generate_ids([ids(generator, 50)], greedy)  # one-off prompts, an entry each
    before = engine.stats()["prefix_cache_hit_tokens"]
    third = system + ids(generator, 7)
    assert engine.generate_ids([third], greedy)[0] == reference(model, third, 2)
    assert engine.stats()["prefix_cache_hit_tokens"] - before == 32
