"""`k3 serve` under hostile and careless input: numeric fields past the kernels' range, an engine that dies,
oversized bodies and prompts, slow and idle connections, too many connections, cross-origin requests. Each test
checks one property, and that the server still answers afterwards."""

import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_helpers import Server, make_run  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("hardening") / "run")


@pytest.fixture(scope="module")
def servers(run):
    """Both long-lived servers of this file, started side by side (each start-up is seconds of imports on one
    core): the plain one and `limited`, with small limits, so that passing them is quick."""
    started = {}
    try:
        started["server"] = Server(run, "--max-batch", "4", "--max-context", "128", "--max-queue", "16", wait=False)
        started["limited"] = Server(run, "--max-context", "128", "--max-body-mb", "1", "--header-timeout", "1",
                                    "--keep-alive-timeout", "1", "--max-connections", "8", "--allowed-origins",
                                    "http://ok.example", wait=False)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["server"].ready()


def completion(server, **fields):
    return server.http.post("/v1/completions", json={"model": "tiny", "prompt": "print(", "max_tokens": 2,
                                                     "temperature": 0, **fields})


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("seed", 2**80), ("seed", -2**63 - 1),
                                          ("top_k", 2**70)])
def test_a_huge_number_is_answered_and_the_next_request_served(server, field, value):
    response = completion(server, **{field: value})
    if field == "seed":
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed", response.text
    else:  # clipped to the vocabulary
        assert response.status_code == 200, response.text
    assert completion(server).status_code == 200
    assert server.http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def dying(run):
    """The three processes whose engine fails, started side by side: a server that exits, one told to keep
    serving, and a start whose warm-up fails (each start-up is seconds of imports on one core)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    started = {}
    try:
        started["exits"] = Server(run, module="dying_serve", wait=False)
        started["keeps"] = Server(run, "--keep-serving-after-engine-error", module="dying_serve", wait=False)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                                               os.environ.get("PYTHONPATH", "")]))
        started["warm-up"] = subprocess.Popen([sys.executable, "-m", "dying_serve", "serve", "--run", str(run),
                                               "--port", "0", "--device", "cpu", "--warm-up-dies"],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        yield started
    finally:
        for process in started.values():
            if isinstance(process, Server):
                process.stop()
            elif process.poll() is None:
                process.kill()
                process.communicate(timeout=30)


def test_the_engine_thread_starts_after_the_compiler_modules_are_imported(run):
    """The engine's first forward and the grammar library both import torch._dynamo; imported by two threads at
    once, one of them got a half-initialised module and the engine loop stopped (an ImportError). The server
    now imports them before any of its threads starts."""
    spied = Server(run, "--max-context", "128", module="threads_serve")
    try:
        assert completion(spied).status_code == 200
    finally:
        spied.stop()
    started = [line for line in spied.lines if line.startswith("thread k3-")]
    names = {line.split()[1] for line in started}
    assert {"k3-engine", "k3-grammar-setup"} <= names, spied.log()
    assert all("compiler=True" in line and "grammar=True" in line for line in started), started


def test_an_engine_that_dies_makes_the_process_exit_non_zero(dying):
    server = dying["exits"].ready()
    try:
        assert completion(server).status_code == 503
        assert server.process.wait(timeout=30) == 1
        assert "the engine loop stopped" in server.log() and "injected engine failure" in server.log()
    finally:
        server.stop()


def test_a_warmup_that_fails_makes_the_process_exit_non_zero(dying):
    stdout, stderr = dying["warm-up"].communicate(timeout=120)
    assert dying["warm-up"].returncode == 1
    assert "injected engine failure" in stderr + stdout


def test_an_engine_that_dies_keeps_answering_503_when_told_to(dying):
    server = dying["keeps"].ready()
    try:
        assert completion(server).status_code == 503
        health = server.http.get("/health")
        assert health.status_code == 503 and "injected engine failure" in health.json()["status"]
        time.sleep(0.5)  # the watcher polls every 0.2 s: long enough for a wrong exit to have happened
        assert server.process.poll() is None
    finally:
        server.stop()


@pytest.fixture(scope="module")
def limited(servers):
    return servers["limited"].ready()


def test_a_20m_character_prompt_is_refused_fast_while_health_answers(server):
    big = {"model": "tiny", "prompt": "x" * 20_000_000, "max_tokens": 1}
    result = {}

    def post():
        started = time.monotonic()
        result["response"] = server.http.post("/v1/completions", json=big)
        result["elapsed"] = time.monotonic() - started

    sender = threading.Thread(target=post)
    sender.start()
    slowest_health = 0.0
    with httpx.Client(base_url=server.url, timeout=30) as other:
        while sender.is_alive():
            started = time.monotonic()
            assert other.get("/health").status_code == 200
            slowest_health = max(slowest_health, time.monotonic() - started)
    sender.join()
    response = result["response"]
    assert response.status_code == 400, response.text
    assert "characters" in response.json()["error"]["message"]
    # Tokenizing 20M characters takes tens of seconds on the event loop; refusing first takes well under these.
    assert result["elapsed"] < 10, f"refusing took {result['elapsed']:.1f} s"
    assert slowest_health < 5, f"/health took {slowest_health:.1f} s meanwhile"
    assert completion(server).status_code == 200


def test_a_body_past_the_limit_is_a_413(limited):
    response = limited.http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"y" * 2_000_000
                                 + b'"}', headers={"content-type": "application/json"})
    assert response.status_code == 413 and "--max-body-mb" in response.json()["error"]["message"]
    assert completion(limited).status_code == 200


def test_a_connection_that_never_finishes_its_headers_is_closed(limited):
    with socket.create_connection(_address(limited), timeout=10) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n")  # and nothing more
        started = time.monotonic()
        assert slow.recv(1024) == b""  # the server closed it
        assert 0.5 < time.monotonic() - started < 8
    assert completion(limited).status_code == 200


def test_connections_past_the_cap_are_refused_at_once(limited):
    held = [socket.create_connection(_address(limited), timeout=10) for _ in range(8)]
    try:
        with socket.create_connection(_address(limited), timeout=10) as extra:
            assert extra.recv(1024).startswith(b"HTTP/1.1 503")
    finally:
        for connection in held:
            connection.close()
    _wait(lambda: completion(limited).status_code == 200, "a request served once the connections closed")


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_429(server):
    response = completion(server, prompt=["print("] * 17)  # the fixture's --max-queue is 16
    assert response.status_code == 400 and "--max-queue" in response.json()["error"]["message"]


def test_a_web_page_cannot_post_to_the_server(server):
    # What a page's fetch() may send cross-origin without a preflight: text/plain, with its Origin.
    response = server.http.post("/v1/completions", headers={"origin": "http://evil.example",
                                                            "content-type": "text/plain"},
                                content=b'{"model": "tiny", "prompt": "print(", "max_tokens": 1}')
    assert response.status_code == 403 and "--allowed-origins" in response.json()["error"]["message"]


def test_an_allowed_origin_gets_cors_headers(limited):
    response = limited.http.post("/v1/completions", headers={"origin": "http://ok.example"},
                                 json={"model": "tiny", "prompt": "print(", "max_tokens": 1})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://ok.example"
    assert limited.http.post("/v1/completions", headers={"origin": "http://evil.example"},
                             json={"model": "tiny", "prompt": "x"}).status_code == 403


def test_a_foreign_host_header_is_refused_on_loopback(server):
    # DNS rebinding: a page's own host name resolving to 127.0.0.1.
    response = server.http.get("/health", headers={"host": "evil.example"})
    assert response.status_code == 400
    assert server.http.get("/health", headers={"host": "localhost"}).status_code == 200


def _address(server):
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _wait(predicate, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.1)
