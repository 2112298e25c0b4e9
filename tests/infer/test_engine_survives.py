"""One request's failure ends that request, not the engine: the AsyncEngine loop fails the requests a raising
step was running and serves the next ones; only an engine that keeps failing (or whose loop gets a
BaseException) stops, and then it says why."""

import asyncio
import logging
import time

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.async_engine import MAX_FAILED_STEPS, AsyncEngine, EngineDead, RequestFailed
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM


class ByteTokenizer:
    vocab_size, eos_token_id, bos_token_id = 256, 0, None

    def encode(self, text):
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")


@pytest.fixture
def aengine():
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    aengine = AsyncEngine(Engine(model, ByteTokenizer(), max_context=128, max_batch=4, page_size=16,
                                 prefill_chunk=32), idle_wait_s=0.01)
    yield aengine
    aengine.shutdown()


async def _collect(aengine, prompt, params):
    return [event.token_id async for event in aengine.stream(prompt, params)]


def _fail_steps(aengine, count, error):
    """Make the next `count` engine steps raise `error`."""
    real, left = aengine.engine.step, [count]

    def step():
        if left[0]:
            left[0] -= 1
            raise error
        return real()
    aengine.engine.step = step


def _wait_idle(aengine, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = aengine.stats()
        if stats["running"] == stats["waiting"] == stats["kda_slots_used"] == stats["mla_pages_used"] == 0:
            return
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        time.sleep(0.01)


GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


def test_a_failing_step_fails_its_request_and_the_next_one_is_served(aengine, caplog):
    _fail_steps(aengine, 1, RuntimeError("boom in one request's step"))
    with caplog.at_level(logging.ERROR, logger="k3.engine"):
        with pytest.raises(RequestFailed, match="boom"):
            asyncio.run(_collect(aengine, [5, 6, 7], GREEDY))
    assert "an engine step failed" in caplog.text
    assert len(asyncio.run(_collect(aengine, [5, 6, 7], GREEDY))) == 4
    assert aengine.error is None
    _wait_idle(aengine)


def test_an_engine_that_keeps_failing_stops_and_says_why(aengine, caplog):
    _fail_steps(aengine, 10 * MAX_FAILED_STEPS, RuntimeError("device lost"))
    with caplog.at_level(logging.ERROR, logger="k3.engine"):
        for _ in range(MAX_FAILED_STEPS - 1):
            with pytest.raises(RequestFailed):
                asyncio.run(_collect(aengine, [5, 6], GREEDY))
        with pytest.raises(EngineDead, match="device lost"):
            asyncio.run(_collect(aengine, [5, 6], GREEDY))
    assert "device lost" in repr(aengine.error)
    assert "the engine loop stopped" in caplog.text
    with pytest.raises(EngineDead, match="device lost"):
        asyncio.run(_collect(aengine, [5, 6], GREEDY))


def test_an_out_of_range_seed_is_refused_before_the_engine(aengine):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(max_new_tokens=2, seed=2**64)
    # The largest accepted seed plus a sample index wraps instead of overflowing the generator's seed.
    params = SamplingParams(max_new_tokens=2, temperature=1.0, seed=2**64 - 1, n=2)
    events = asyncio.run(_collect(aengine, [5, 6], params))
    assert len(events) == 4 and aengine.error is None


def test_top_k_past_the_vocabulary_means_all_of_it(aengine):
    huge = SamplingParams(max_new_tokens=3, temperature=1.0, seed=1, top_k=2**70)
    off = SamplingParams(max_new_tokens=3, temperature=1.0, seed=1, top_k=0)
    assert asyncio.run(_collect(aengine, [5, 6], huge)) == asyncio.run(_collect(aengine, [5, 6], off))
