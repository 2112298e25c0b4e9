"""`k3 serve --model` (a Hugging Face-format directory with its own chat template) under overload and on
shutdown: more waiting requests than --max-queue get HTTP 429 at once (never a hang), and SIGINT stops the
server cleanly (exit code 0), ending open streams."""

import json
import signal
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_helpers import Server, make_hf_model, make_run  # noqa: E402

from k3.infer.sse import parse_sse  # noqa: E402

LONG = {"model": "tiny", "prompt": "print(", "max_tokens": 3000, "temperature": 0, "stream": True}


TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("jinja2")
    root = tmp_path_factory.mktemp("overload")
    return make_hf_model(make_run(root / "run"), root / "hf", TEMPLATE)


def send_raw(server: Server, body: dict) -> socket.socket:
    """Send a request and leave its answer unread (a client that is waiting)."""
    host, port = server.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return sock


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server(model_dir, "--max-batch", "1", "--max-queue", "1", "--max-context", "4096", hf=True)
    try:
        yield server
    finally:
        server.stop()


def test_the_directorys_chat_template_is_used(server, model_dir):
    from k3.data.tokenizer import load_tokenizer

    assert "chat format: custom (tokenizer)" in server.log()
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    choice = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    expected = load_tokenizer(model_dir).encode("<system>Be brief.\n<user>hi\n<assistant>")
    assert choice["prompt_token_ids"] == expected and len(choice["token_ids"]) == 3
    server.wait_idle()


def test_a_full_queue_is_a_429_at_once_and_nothing_leaks(server):
    with send_raw(server, LONG):
        server.wait_until(lambda h: h["running"] == 1, "the first request taking the only slot")
        with send_raw(server, LONG):
            server.wait_until(lambda h: h["waiting"] == 1, "the second request queueing")
            # A third would make two waiting requests with --max-queue 1: refused at once, not queued.
            response = server.http.post("/v1/completions", json={**LONG, "stream": False}, timeout=10)
            assert response.status_code == 429, response.text
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert "max-queue 1" in error["message"] and response.headers["retry-after"] == "1"
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            assert server.http.post("/v1/chat/completions", json=chat, timeout=10).status_code == 429
            assert server.health()["waiting"] == 1
        server.wait_until(lambda h: h["waiting"] == 0, "the queued request leaving with its client")
    server.wait_idle()
    metrics = dict(line.rsplit(" ", 1) for line in server.http.get("/metrics").text.splitlines() if line[0] != "#")
    assert metrics['k3_requests_total{outcome="rejected"}'] == "2"
    assert metrics['k3_requests_total{outcome="aborted"}'] == "2"
    # Still serving after all that.
    ok = server.http.post("/v1/completions", json={**LONG, "max_tokens": 3, "stream": False})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_sigint_stops_a_busy_server_cleanly(server):
    """Last in this file: it stops the module's server. An open stream ends at once (finish_reason "abort")
    instead of running its 3000 tokens; the process exits 0. (SIGTERM: test_server.py's last test.)"""
    with server.http.stream("POST", "/v1/completions", json=LONG) as response:
        events = parse_sse(response.iter_lines())
        next(events)
        server.process.send_signal(signal.SIGINT)
        rest = list(events)
        assert rest and rest[-1]["choices"][0]["finish_reason"] == "abort"
    code = server.process.wait(timeout=30)  # one signal is enough (a second SIGINT would force it)
    assert code == 0, server.log()
    assert "k3 serve: stopped" in server.log() and "Traceback" not in server.log(), server.log()
