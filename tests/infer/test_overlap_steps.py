"""Overlapped steps (EngineConfig.overlap_steps): a decode step is launched before the previous step's tokens are
read, so its rows take their inputs from the device and every token is booked one step later. What a request
gets must not change: the same tokens, logprobs, finish reasons and events as plain steps, whatever finishes,
arrives or is aborted while a step is in flight, and nothing of the pool left held."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer import engine as engine_module
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


def prompts(count, seed=0, low=3, high=40):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(1, 256, (n,), generator=generator).tolist() for n in lengths]


def count_launches(monkeypatch):
    launches = []
    launch = engine_module._InFlight.launch.__func__

    def counted(cls, rows, params, sampled):
        launches.append(len(rows))
        return launch(cls, rows, params, sampled)

    monkeypatch.setattr(engine_module._InFlight, "launch", classmethod(counted))
    return launches


def assert_same(got, want):
    """Tokens and finish reasons exactly; logprobs within 1e-5 (a step in flight makes some batches a row larger or
    smaller, which moves fp32 sums in their last bits)."""
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            if b.top_logprobs is not None:
                assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
                assert [v for top in a.top_logprobs for _, v in top] == pytest.approx(
                    [v for top in b.top_logprobs for _, v in top], abs=1e-5)


def test_overlapped_steps_give_what_plain_steps_give(model, monkeypatch):
    """Rows that finish at different steps (lengths, a stop token, a stop at the context's end), top logprobs,
    seeded sampling with n=2: every completion equal, and most steps were overlapped."""
    batch = prompts(6)
    plain = Engine(model, None, max_context=64, max_batch=8, overlap_steps=False)
    params = [SamplingParams(max_new_tokens=n, temperature=0, logprobs=2) for n in (3, 9, 17, 30)]
    params.append(SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7, n=2, logprobs=0))
    params.append(SamplingParams(max_new_tokens=40, temperature=0))  # runs into max_context
    want = plain.complete(batch, params)
    # A stop token the first request meets on its way (its 2nd greedy token), so it ends early in both.
    params[3] = SamplingParams(max_new_tokens=30, temperature=0, logprobs=2,
                               stop_token_ids=[want[3].outputs[0].token_ids[4]])
    want = plain.complete(batch, params)
    launches = count_launches(monkeypatch)
    overlapped = Engine(model, None, max_context=64, max_batch=8, overlap_steps=True)
    got = overlapped.complete(batch, params)
    assert_same(got, want)
    assert want[3].outputs[0].finish_reason == "stop" and len(want[3].outputs[0].token_ids) == 5
    assert len(launches) > 20  # the decode steps went through the overlapped path
    overlapped.step()  # lands the last step in flight (rows that had finished: nothing to book)
    assert not overlapped.has_unfinished()
    stats = overlapped.stats()
    assert stats["kda_slots_used"] == 0 and stats["mla_pages_used"] == 0
    assert stats["generated_tokens"] == sum(len(c.token_ids) for r in want for c in r.outputs)
    assert stats["overlapped_steps"] == len(launches) and plain.stats()["overlapped_steps"] == 0


def test_events_are_the_same_and_arrive_one_step_late(model):
    batch = prompts(3, seed=1)
    params = SamplingParams(max_new_tokens=6, temperature=0)
    streams = {}
    for overlap in (False, True):
        engine = Engine(model, None, max_context=64, max_batch=4, overlap_steps=overlap)
        ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(batch)]
        steps = []
        while engine.has_unfinished():
            steps.append([(e.request_id, e.token_id, e.finished, e.finish_reason) for e in engine.step()])
        streams[overlap] = steps
        assert ids == ["r0", "r1", "r2"]
    flat = {overlap: [event for step in steps for event in step] for overlap, steps in streams.items()}
    assert flat[True] == flat[False]
    # The first tokens come with the prefill (a plain step); each later one a step after the plain engine's.
    first = [i for i, step in enumerate(streams[False]) if step][1]
    assert streams[True][first] == [] and streams[True][first + 1] == streams[False][first]


def test_arrivals_and_an_abort_while_a_step_is_in_flight(model, monkeypatch):
    """A request added mid-decode (its prefill makes the next step plain), one aborted while a step holding it is in
    flight: the others complete as on plain steps, the aborted one gets no event after its abort, and the pool is
    empty at the end."""
    first, later = prompts(3, seed=2), prompts(2, seed=3)
    params = SamplingParams(max_new_tokens=10, temperature=0, logprobs=0)
    launches = count_launches(monkeypatch)
    results = {}
    for overlap in (False, True):
        engine = Engine(model, None, max_context=64, max_batch=4, overlap_steps=overlap)
        events = {}
        for i, p in enumerate(first):
            engine.add_request(p, params, request_id=f"a{i}")
        for step in range(40):
            if step == 3:
                for i, p in enumerate(later):
                    engine.add_request(p, params, request_id=f"b{i}")
            if step == 5:
                assert engine.abort("a1")
            for event in engine.step():
                events.setdefault(event.request_id, []).append((event.token_id, event.logprob, event.finish_reason))
            if not engine.has_unfinished():
                break
        assert not engine.has_unfinished()
        stats = engine.stats()
        assert stats["kda_slots_used"] == 0 and stats["mla_pages_used"] == 0 and stats["running"] == 0
        results[overlap] = events
    plain, overlapped = results[False], results[True]
    def same(a, b):
        return ([(t, r) for t, _, r in a] == [(t, r) for t, _, r in b]
                and [lp for _, lp, _ in a] == pytest.approx([lp for _, lp, _ in b], abs=1e-5))

    for rid in ("a0", "a2", "b0", "b1"):
        assert same(overlapped[rid], plain[rid]) and len(plain[rid]) == 10 and plain[rid][-1][2] == "length"
    # Aborted after step 5: the plain engine had booked its tokens of steps 0-4, the overlapped one those of 0-3.
    assert len(overlapped["a1"]) == len(plain["a1"]) - 1 and same(overlapped["a1"], plain["a1"][:-1])
    assert all(reason is None for _, _, reason in overlapped["a1"])
    assert launches


def test_grammar_or_penalty_rows_keep_their_steps_plain(model, monkeypatch):
    """A penalised row needs each token on the host before the next step: while it runs no step is overlapped,
    and it gets what plain steps give it."""
    batch = prompts(2, seed=4)
    params = [SamplingParams(max_new_tokens=8, temperature=0, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=8, temperature=0)]
    want = Engine(model, None, max_context=64, max_batch=4).complete(batch, params)
    launches = count_launches(monkeypatch)
    got = Engine(model, None, max_context=64, max_batch=4, overlap_steps=True).complete(batch, params)
    assert_same(got, want)
    assert launches == []


def test_k3_serve_with_overlap_steps_answers_as_without(tmp_path):
    """The flag reaches the served engine (EngineConfig through the CLI): the same greedy text, streamed or not."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from server_helpers import Server, make_run

    run = make_run(tmp_path / "run")
    answers = {}
    for flags in ((), ("--overlap-steps",)):
        server = Server(run, "--max-batch", "4", "--max-context", "128", *flags)
        try:
            with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
                whole = client.completions.create(model="tiny", prompt="print('line", max_tokens=12, temperature=0)
                streamed = client.completions.create(model="tiny", prompt="print('line", max_tokens=12,
                                                     temperature=0, stream=True)
                answers[flags] = (whole.choices[0].text, "".join(c.choices[0].text for c in streamed),
                                  whole.choices[0].finish_reason)
            server.wait_idle()
        finally:
            server.stop()
    assert answers[()] == answers[("--overlap-steps",)] and answers[()][2] == "length"
    assert answers[()][0] == answers[()][1] and answers[()][0]
