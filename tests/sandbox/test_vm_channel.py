"""The host side of the microVM agent protocol against hostile guests (no VM needed): every
wait ends by its deadline, oversized and malformed frames are refused, late answers are dropped.
One hostile property per test."""

import json
import socket
import struct
import time

import pytest

from k3.sandbox.vm.channel import AgentError, AgentTimeout, Channel


def _frame(message) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body


@pytest.fixture
def pair():
    host, guest = socket.socketpair()
    yield Channel(host, max_bytes=1 << 20), guest
    host.close()
    guest.close()


def test_silent_agent_times_out_by_its_deadline(pair):
    channel, _guest = pair
    start = time.monotonic()
    with pytest.raises(AgentTimeout):
        channel.call({"op": "ping"}, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 5.0
    with pytest.raises(AgentError, match="broken"):  # the stream may be mid-frame: no more calls
        channel.call({"op": "ping"}, timeout=0.3)


def test_agent_that_stops_mid_frame_times_out(pair):
    channel, guest = pair
    guest.sendall(_frame({"id": 1, "ok": True})[:7])
    with pytest.raises(AgentTimeout):
        channel.call({"op": "ping"}, timeout=0.3)


def test_oversized_reply_is_refused_before_it_is_read(pair):
    channel, guest = pair
    guest.sendall(struct.pack(">I", 1 << 30))  # announces 1 GiB; nothing more is sent
    with pytest.raises(AgentError, match="over the limit"):
        channel.call({"op": "ping"}, timeout=5.0)
    assert len(channel._buffer) == 0


def test_reply_that_is_not_json_is_an_error(pair):
    channel, guest = pair
    guest.sendall(struct.pack(">I", 5) + b"\xff\xfe{[(")
    with pytest.raises(AgentError, match="not JSON"):
        channel.call({"op": "ping"}, timeout=5.0)


def test_reply_that_is_not_an_object_is_an_error(pair):
    channel, guest = pair
    guest.sendall(_frame([1, 2, 3]))
    with pytest.raises(AgentError, match="not a JSON object"):
        channel.call({"op": "ping"}, timeout=5.0)


def test_late_answer_to_another_request_is_dropped(pair):
    channel, guest = pair
    guest.sendall(_frame({"id": 999, "ok": True, "stale": True}) + _frame({"id": 1, "ok": True, "pid": 7}))
    assert channel.call({"op": "ping"}, timeout=5.0) == {"id": 1, "ok": True, "pid": 7}


def test_closed_connection_is_an_error_not_a_hang(pair):
    channel, guest = pair
    guest.close()
    with pytest.raises(AgentError, match="closed|failed"):
        channel.call({"op": "ping"}, timeout=5.0)


def test_agent_bounds_command_output():
    # The guest side cuts output at max_output too (the host limit is the backstop).
    from k3.sandbox.vm.agent import run_command

    answer = run_command({"argv": ["/bin/sh", "-c", "head -c 100000 /dev/zero"], "max_output": 1000, "timeout": 30})
    assert answer["truncated"] and len(__import__("base64").b64decode(answer["stdout"])) == 1000
