import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine, Session, greedy_without_cache
from k3.infer.sampling import SamplingParams, filter_logits, sample_next
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


def greedy(max_new_tokens, stop=()):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop))


def test_cached_greedy_equals_recomputing_without_cache(model):
    engine = Engine(model, tokenizer=None, max_context=512)
    torch.manual_seed(1)
    prompt = torch.randint(1, 256, (37,)).tolist()
    cached = engine.generate_ids([prompt], greedy(40))[0]
    assert cached == greedy_without_cache(model, prompt, 40)


def test_batch_of_prompts_equals_each_prompt_alone(model):
    engine = Engine(model, tokenizer=None, max_context=512)
    torch.manual_seed(2)
    prompts = [torch.randint(1, 256, (n,)).tolist() for n in (5, 19, 19, 64, 5)]
    together = engine.generate_ids(prompts, greedy(12))
    for prompt, out in zip(prompts, together):
        assert out == greedy_without_cache(model, prompt, 12)


def test_stop_tokens_end_one_row_and_not_the_others(model):
    engine = Engine(model, tokenizer=None, max_context=512)
    prompts = [[3, 4, 5], [9, 8, 7]]
    free = engine.generate_ids(prompts, greedy(10))
    stop = free[0][2]
    stopped = engine.generate_ids(prompts, greedy(10, stop=[stop]))
    assert stopped[0] == free[0][:free[0].index(stop) + 1]
    cut = free[1].index(stop) + 1 if stop in free[1] else len(free[1])
    assert stopped[1] == free[1][:cut]


def test_prompt_longer_than_the_context_is_refused(model):
    engine = Engine(model, tokenizer=None, max_context=16)
    with pytest.raises(ValueError, match="prompt 1 has 16 tokens but the context allows 16.*--max-context"):
        engine.generate_ids([[1, 2], list(range(1, 17))], greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate_ids([[]], greedy(4))
    # generation stops at the context limit
    assert len(engine.generate_ids([list(range(1, 11))], greedy(50))[0]) == 6


def test_session_continues_the_cache_exactly(model):
    engine = Engine(model, ByteTokenizer(), max_context=512)
    first, second = [5, 6, 7, 8], [9, 10, 11]
    session = Session(engine)
    session.feed(first)
    reply = session.generate(greedy(6))
    session.feed(second)
    reply2 = session.generate(greedy(5))
    assert reply == greedy_without_cache(model, first, 6)
    assert reply2 == greedy_without_cache(model, first + reply + second, 5)


def test_text_generation_and_seeded_sampling(model):
    engine = Engine(model, ByteTokenizer(), max_context=512)
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
