"""Gathering new prompts (EngineConfig.gather_prompts_ms): a new prompt's first forward waits while others keep
arriving, so that a burst shares prefill forwards, but never longer than the limit, never when the new prompts
already fill a step, and never holding up the rows that decode. The engine's clock is a fake one here."""

import asyncio
import threading

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.engine_config import EngineConfig
from k3.infer.sampling import SamplingParams
from k3.infer.scheduler import GATHER_QUIET_S
from k3.model import K3ForCausalLM
from prefill_spy import spy_prefills

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gathering_engine(model, gather_ms=20.0, **options):
    # Plain steps: a step's tokens come with it (overlapped steps would hand them out a step later).
    engine = Engine(model, None, max_context=128, max_batch=8, page_size=16, prefix_cache=False,
                    gather_prompts_ms=gather_ms, overlap_steps=False, **options)
    clock = Clock()
    engine.scheduler.clock = clock
    forwards = []
    spy_prefills(engine, lambda start, end: forwards.append(sorted(end) if isinstance(end, list) else [end]))
    return engine, clock, forwards


def prompt(n, seed):
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_burst_shares_one_forward_once_arrivals_pause(model):
    engine, clock, forwards = gathering_engine(model)
    engine.add_request(prompt(20, 1), GREEDY)
    assert engine.step() == [] and forwards == []  # one arrived just now: more may follow
    assert engine.gather_wait_s() == pytest.approx(GATHER_QUIET_S)
    clock.now += 0.001
    engine.add_request(prompt(30, 2), GREEDY)
    clock.now += 0.001
    engine.add_request(prompt(25, 3), GREEDY)
    assert engine.step() == [] and forwards == []
    clock.now += GATHER_QUIET_S  # none arrived for the quiet time
    events = engine.step()
    assert forwards == [[20, 25, 30]] and len(events) == 3  # one padded forward, each prompt's first token
    assert engine.stats()["prefill_forwards"] == 1 and engine.stats()["steps"] == 1  # waiting steps not counted


def test_arrivals_that_never_pause_wait_at_most_the_limit(model):
    engine, clock, forwards = gathering_engine(model, gather_ms=5.0)
    for i in range(4):  # a prompt every millisecond: never quiet
        engine.add_request(prompt(10, 10 + i), GREEDY)
        assert engine.step() == [] and forwards == []
        clock.now += 0.001
    clock.now += 0.0011  # 5.1 ms after the first prompt, 2.1 after the last: either rule would release them
    engine.add_request(prompt(10, 20), GREEDY)  # one more just now: the quiet rule alone would hold
    engine.step()
    assert len(forwards) == 1 and len(forwards[0]) == 5


def test_new_prompts_that_fill_a_step_run_at_once(model):
    engine, clock, forwards = gathering_engine(model, max_step_tokens=64, prefill_chunk=64)
    engine.add_request(prompt(40, 30), GREEDY)
    engine.add_request(prompt(30, 31), GREEDY)  # 70 tokens > the step's 64: gathering more cannot help
    engine.step()
    assert forwards and forwards[0] == [40]


def test_decoding_rows_step_on_while_new_prompts_gather(model):
    engine, clock, forwards = gathering_engine(model)
    first = engine.add_request(prompt(12, 40), SamplingParams(max_new_tokens=8, temperature=0))
    clock.now += 1.0
    engine.step()  # its prefill (alone, long after it arrived) and first token
    assert forwards == [[12]]
    engine.add_request(prompt(16, 41), GREEDY)
    events = engine.step()  # the new prompt waits; the running row decodes
    assert [e.request_id for e in events] == [first] and forwards == [[12]]
    assert engine.gather_wait_s() == 0.0  # rows are decoding: the loop must keep stepping
    clock.now += GATHER_QUIET_S
    engine.step()
    assert forwards == [[12], [16]]


def test_off_by_default_and_the_limit_is_range_checked(model):
    engine = Engine(model, None, max_context=128, max_batch=4, page_size=16, prefix_cache=False)
    assert engine.scheduler.gather_s == 0.0
    forwards = []
    spy_prefills(engine, lambda start, end: forwards.append(end))
    engine.add_request(prompt(10, 50), GREEDY)
    engine.step()
    assert forwards in ([10], [[10]])
    for bad in (-1.0, 1e6):
        with pytest.raises(ValueError, match="gather_prompts_ms must be in"):
            EngineConfig(gather_prompts_ms=bad)


def test_an_async_engine_serves_gathered_prompts_without_spinning(model):
    """With the real clock: requests added to an idle AsyncEngine complete as without gathering, and the engine
    thread sleeps while they gather instead of stepping in a loop (it would hold the interpreter the requests
    arrive through)."""
    plain = Engine(model, None, max_context=128, max_batch=8, page_size=16, prefix_cache=False)
    prompts = [prompt(n, 60 + n) for n in (20, 22, 23)]  # within one padded forward's padding
    want = [r.outputs[0].token_ids for r in plain.complete(prompts, GREEDY)]
    engine = Engine(model, None, max_context=128, max_batch=8, page_size=16, prefix_cache=False,
                    gather_prompts_ms=50.0)
    empty_steps = []
    real_step = engine.step

    def counted_step():
        events = real_step()
        if not events and engine.scheduler.gathering_until is not None:
            empty_steps.append(1)
        return events

    engine.step = counted_step
    aengine = AsyncEngine(engine)
    try:
        done = threading.Event()
        got = {}

        def sink(request_id, items):  # runs on the event loop
            for item in items:
                got.setdefault(request_id, []).append(item.token_id)
            if sum(len(v) for v in got.values()) == 3 * GREEDY.max_new_tokens:
                done.set()

        async def run():
            with aengine.lock:  # all three in the inbox before the engine thread drains it: one burst
                ids = [aengine.add(p, GREEDY, sink=sink) for p in prompts]
            for _ in range(400):  # at most 4 s
                if done.is_set():
                    break
                await asyncio.sleep(0.01)
            return ids

        ids = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert [got.get(i) for i in ids] == want
    assert engine.stats()["prefill_forwards"] == 1  # added together: one forward
    assert len(empty_steps) <= 10  # slept on its wake-up, not stepping every few microseconds for 2 ms
