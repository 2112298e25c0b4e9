"""`k3 serve` under hostile and careless input: numeric fields past the kernels' range, an engine that dies,
oversized bodies and prompts, slow and idle connections, too many connections, cross-origin requests. Each test
checks one property, and that the server still answers afterwards."""

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
def server(run):
    server = Server(run, "--max-batch", "4", "--max-context", "128", "--max-queue", "16")
    try:
        yield server
    finally:
        server.stop()


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


def test_an_engine_that_dies_makes_the_process_exit_non_zero(run):
    server = Server(run, module="dying_serve")
    try:
        assert completion(server).status_code == 503
        assert server.process.wait(timeout=30) == 1
        assert "the engine loop stopped" in server.log() and "injected engine failure" in server.log()
    finally:
        server.stop()


def test_an_engine_that_dies_keeps_answering_503_when_told_to(run):
    server = Server(run, "--keep-serving-after-engine-error", module="dying_serve")
    try:
        assert completion(server).status_code == 503
        health = server.http.get("/health")
        assert health.status_code == 503 and "injected engine failure" in health.json()["status"]
        time.sleep(0.5)  # the watcher polls every 0.2 s: long enough for a wrong exit to have happened
        assert server.process.poll() is None
    finally:
        server.stop()
