"""Warm-up before ready: `k3 serve` builds what the first requests would (decode graphs, prefill shapes) before
/health reports ready. The warm-up here waits on an event the test sets, so "still warming up" is observable
without timing; then Engine.warmup itself runs."""

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from inprocess_server import InProcessServer  # noqa: E402
from prefill_spy import spy_prefills  # noqa: E402


def _tiny():
    import torch

    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.model import K3ForCausalLM

    tokenizer = train_bpe(["warm up the engine before the first request " * 4] * 4, vocab_size=280,
                          show_progress=False)
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)).eval(), tokenizer


def test_health_is_503_while_warming_up_then_200_and_the_first_request_works():
    model, tokenizer = _tiny()
    release, calls = threading.Event(), []
    engine_box = {}

    def warmup():
        assert release.wait(60), "the test never released the warm-up"
        calls.append(engine_box["engine"].warmup())

    server = InProcessServer(model, tokenizer, max_context=128, max_batch=4, warmup=warmup)
    engine_box["engine"] = server.engine
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "warming up"
            assert health.json()["warmup_s"] is None
            release.set()
            assert server.aengine.ready.wait(60)
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert health.json()["warmup_s"] > 0 and len(calls) == 1 and calls[0] > 0
            # The warm-up left no trace in the counters or the prefix cache, and nothing running.
            assert health.json()["generated_tokens"] == 0 and health.json()["prefix_entries"] == 0
            assert health.json()["running"] == 0 and health.json()["waiting"] == 0
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
            out = http.post("/v1/completions", json=body)
            assert out.status_code == 200, out.text
            assert len(out.json()["choices"][0]["text"]) > 0 and out.json()["usage"]["completion_tokens"] == 4
    finally:
        release.set()
        server.stop()


def test_a_request_sent_during_warm_up_waits_and_is_served():
    model, tokenizer = _tiny()
    release = threading.Event()
    server = InProcessServer(model, tokenizer, max_context=128, max_batch=4,
                             warmup=lambda: release.wait(60) and server.engine.warmup())
    try:
        results = []
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        sender = threading.Thread(target=lambda: results.append(httpx.post(server.url + "/v1/completions",
                                                                           json=body, timeout=60)))
        sender.start()
        sender.join(0.5)  # bounded: the request is still waiting for the warm-up (or done, which is the bug)
        assert not results, "a request was answered before the engine had warmed up"
        release.set()
        sender.join(60)
        assert results and results[0].status_code == 200
        assert results[0].json()["usage"]["completion_tokens"] == 3
    finally:
        release.set()
        server.stop()


def test_warmup_leaves_the_engine_as_it_was_and_outputs_unchanged():
    """Greedy tokens after a warm-up equal those of an engine that never warmed up."""
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    model, tokenizer = _tiny()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    cold = Engine(model, tokenizer, max_context=128, max_batch=4).generate_ids([[3, 4, 5, 6]], params)
    warm_engine = Engine(model, tokenizer, max_context=128, max_batch=4)
    before = warm_engine.stats()
    assert warm_engine.warmup() > 0
    assert warm_engine.stats() == before
    assert warm_engine.generate_ids([[3, 4, 5, 6]], params) == cold


def test_warmup_prefills_a_full_chunk_a_round_length_and_a_padded_pair():
    """Kernels specialise per shape: the warm-up's prefill forwards cover a full chunk (125 tokens of a 128-token
    context), a multiple of 64, and two short prompts of different lengths in one padded forward."""
    from k3.infer.engine import Engine

    model, tokenizer = _tiny()
    engine = Engine(model, tokenizer, max_context=128, max_batch=4, prefix_cache=False)  # no page-boundary cuts
    calls = []
    spy_prefills(engine, lambda start, end: calls.append((start, end)))
    engine.warmup()
    assert calls == [([0], [125]), ([0], [64]), ([0, 0], [17, 15])]


def test_warmup_prefills_sixteen_rows_in_one_forward_where_the_batch_allows():
    """Triton builds a kernel apart for an integer argument that is a multiple of 16: with max_batch >= 16 the
    warm-up also runs one forward of 16 rows, so a burst of 16 prompts compiles nothing after ready."""
    from k3.infer.engine import WARM_ROW_TOKENS, WARM_ROWS, Engine

    model, tokenizer = _tiny()
    for max_batch, expected in ((16, True), (8, False)):
        engine = Engine(model, tokenizer, max_context=128, max_batch=max_batch, prefix_cache=False)
        calls = []
        spy_prefills(engine, lambda start, end: calls.append((start, end)))
        engine.warmup()
        assert (([0] * WARM_ROWS, [WARM_ROW_TOKENS] * WARM_ROWS) in calls) is expected, calls


def test_warmup_attends_after_cached_tokens_and_takes_the_prefix_cache_paths():
    """Attention after cached tokens is a path of its own (a lower-right causal mask, whose first use imported
    torch._dynamo: a fresh engine's first long prompt took 1.26 s against 0.09 s on the CPU): the warm-up runs a
    chunk and 64 tokens more. With the prefix cache on it also runs forwards that save a state on their way and
    next turns whose tails start from two positions in one forward; and leaves the cache empty."""
    from k3.infer.engine import Engine

    model, tokenizer = _tiny()
    for prefix_cache in (False, True):
        engine = Engine(model, tokenizer, max_context=256, max_batch=4, page_size=16, prefill_chunk=64,
                        prefix_cache=prefix_cache)
        calls, snapshots = [], []
        real = engine.runner.prefill

        def prefill(seqs, start, end, saves=None):
            calls.append((start, end))
            snapshots.extend(filter(None, saves or []))
            return real(seqs, start, end, saves)

        engine.runner.prefill = prefill
        engine.warmup()
        assert ([64], [128]) in calls  # the second chunk of a chunk-and-64 prompt
        ragged = [(start, end) for start, end in calls if len(set(start)) > 1]
        if prefix_cache:
            assert {32, 48} <= {position for position, _ in snapshots}, snapshots
            assert [sorted(zip(*call)) for call in ragged] == [[(32, 40), (48, 56)]], calls
            assert len(engine.prefix_cache) == 0 and engine.pool.free_slots == engine.pool.num_slots
        else:
            assert not snapshots and not ragged


def test_a_warmup_that_raises_stops_the_engine_and_health_says_so():
    model, tokenizer = _tiny()

    def broken():
        raise RuntimeError("no memory for the decode graphs")

    server = InProcessServer(model, tokenizer, max_context=128, max_batch=4, warmup=broken)
    try:
        server.aengine._thread.join(30)
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and "no memory for the decode graphs" in health.json()["status"]
    finally:
        server.stop()


def test_a_warm_engine_freezes_its_objects_out_of_the_collector_until_shutdown():
    """freeze_gc: once warm, the objects alive then are out of every later garbage collection (a full one paused
    the whole server); shutdown gives them back, so the interpreter's last collection still frees them."""
    import gc

    from k3.infer.async_engine import AsyncEngine
    from k3.infer.engine import Engine

    model, tokenizer = _tiny()
    assert gc.get_freeze_count() == 0
    aengine = AsyncEngine(Engine(model, tokenizer, max_context=128, max_batch=2), freeze_gc=True)
    try:
        assert aengine.ready.wait(60)
        assert gc.get_freeze_count() > 1000  # the model's tensors and modules among them
    finally:
        aengine.shutdown()
    assert gc.get_freeze_count() == 0


def test_grammar_tokenizer_is_built_before_ready_and_once(monkeypatch):
    """prepare_grammars (k3 serve's warm-up): the grammar library's view of the vocabulary is built in the
    warm-up, /health stays 503 until it is, and later constrained requests reuse it. Built on a first request
    instead, it held every stream up for 2-3 s (bench/serve.py's tools level, stub engine, 2 CPU cores)."""
    import k3.infer.structured as structured

    model, tokenizer = _tiny()
    release, built = threading.Event(), []
    real = structured.GrammarTokenizer

    class Counted(real):
        def __init__(self, *args, **kwargs):
            assert release.wait(60), "the test never released the grammar set-up"
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(structured, "GrammarTokenizer", Counted)
    server = InProcessServer(model, tokenizer, max_context=256, max_batch=4, prepare_grammars=True)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert server.aengine.ready.wait(60)  # the engine is warm; the grammars are not
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "warming up"
            release.set()
            assert server.app.state.k3.grammars_ready.wait(60)
            assert http.get("/health").status_code == 200 and built == [1]
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
            body = {"model": "tiny", "messages": [{"role": "user", "content": "warm"}], "max_tokens": 8,
                    "temperature": 0, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "a", "schema": schema}}}
            for _ in range(2):
                out = http.post("/v1/chat/completions", json=body)
                assert out.status_code == 200, out.text
            assert built == [1]  # the requests took the tokenizer the warm-up built
    finally:
        release.set()
        server.stop()


def test_concurrent_first_uses_build_one_grammar_tokenizer(monkeypatch):
    """Chat requests are planned in worker threads: many constrained ones at once share one build."""
    from types import SimpleNamespace

    import k3.infer.structured as structured
    from k3.infer.server import _Server

    entered, release, built = threading.Event(), threading.Event(), []

    class Slow:
        def __init__(self, tokenizer, vocab_size):
            built.append(self)
            entered.set()
            assert release.wait(60)

    monkeypatch.setattr(structured, "GrammarTokenizer", Slow)
    engine = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(vocab_size=16)))
    server = _Server(engine, "tiny", None, 64, 8, chat_template=None)
    got = []
    first = threading.Thread(target=lambda: got.append(server.grammar_tokenizer()))
    first.start()
    assert entered.wait(60)
    others = [threading.Thread(target=lambda: got.append(server.grammar_tokenizer())) for _ in range(4)]
    for thread in others:
        thread.start()
    release.set()
    for thread in [first, *others]:
        thread.join(60)
    assert len(built) == 1 and len(got) == 5 and all(g is built[0] for g in got)
