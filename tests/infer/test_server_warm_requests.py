"""A fresh `k3 serve` sends itself a completion and a chat request once its engine is warm, before /health reports
ready (k3.infer.warm_requests): the first client request then finds the HTTP path warm too. They pass the API key
check, show in the engine's counters, not in the request metrics, and a failing one never keeps the server from
serving."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from server_helpers import Server, make_run  # noqa: E402

from k3.infer import warm_requests  # noqa: E402
from k3.infer.metrics import ServerMetrics  # noqa: E402


def test_a_fresh_server_is_ready_after_its_own_requests_which_the_metrics_do_not_count(tmp_path):
    server = Server(make_run(tmp_path / "run"), "--max-batch", "4", "--max-context", "128", "--api-key", "sekrit")
    try:
        health = server.health()
        assert health["status"] == "ok"
        # Both went through the key check to the engine: two prompts, two tokens each.
        assert health["finished"] == 2 and health["generated_tokens"] == 4, health
        assert "own warm-up request" not in server.log() and "warm-up requests failed" not in server.log()
        metrics = server.http.get("/metrics").text
        assert '\nk3_requests_total{outcome="finished"} 0\n' in metrics
        assert "\nk3_generation_tokens_total 0\n" in metrics
    finally:
        server.stop()


class FakeServer:
    def __init__(self) -> None:
        self.aengine = SimpleNamespace(ready=threading.Event(), error=None)
        self.grammars_ready, self.warm_requests_done = threading.Event(), threading.Event()
        self.grammars_ready.set()
        self.vocab_size, self.model_name = 50, "tiny"
        self.metrics = ServerMetrics()
        self.metrics.started(3)

    def reset_metrics(self) -> None:
        self.metrics = ServerMetrics()


def test_a_failing_warm_up_request_still_ends_in_ready_with_fresh_metrics(monkeypatch, caplog):
    server, sent = FakeServer(), []

    def refuse(url, body, api_key, timeout_s=0):
        sent.append((url, body["model"], api_key))
        raise ConnectionRefusedError("nobody listens")

    monkeypatch.setattr(warm_requests, "post", refuse)
    server.aengine.ready.set()
    asyncio.run(warm_requests.send_warm_requests(server, "http://0.0.0.0:8123", "key", lambda: False))
    assert server.warm_requests_done.is_set() and server.metrics.prompt_tokens == 0
    assert sent == [("http://127.0.0.1:8123/v1/completions", "tiny", "key")]  # the first failure ends them
    assert "warm-up requests failed" in caplog.text


def test_a_server_stopping_before_its_engine_is_warm_sends_nothing(monkeypatch):
    server, sent = FakeServer(), []
    monkeypatch.setattr(warm_requests, "post", lambda *a, **k: sent.append(a) or (200, ""))
    asyncio.run(warm_requests.send_warm_requests(server, "http://127.0.0.1:8123", None, lambda: True))
    assert not sent and server.warm_requests_done.is_set()


def test_warm_up_prompts_stay_inside_a_tiny_vocabulary():
    for vocab in (2, 3, 50):
        completion = warm_requests.warm_request_bodies(vocab)[0][1]
        assert all(0 < token < vocab for token in completion["prompt"])
    assert warm_requests.loopback("http://[::]:80") == "http://[::1]:80"


def test_a_refused_warm_up_request_is_logged_with_why(monkeypatch, caplog):
    server = FakeServer()
    server.aengine.ready.set()
    monkeypatch.setattr(warm_requests, "post", lambda url, *a, **k: (400, '{"error": "no chat template"}')
                        if url.endswith("/chat/completions") else (200, ""))
    asyncio.run(warm_requests.send_warm_requests(server, "http://127.0.0.1:8123", None, lambda: False))
    assert server.warm_requests_done.is_set()
    assert "/v1/chat/completions answered HTTP 400" in caplog.text and "no chat template" in caplog.text
