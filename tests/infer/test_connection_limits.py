"""The pure parts of k3.infer.connection_limits: the log rate limit and the prompt-size check."""

import logging

import pytest

from k3.infer.connection_limits import RateLimitFilter, ServerLimits, check_prompt_chars
from k3.infer.protocol import APIError


def _record(message):
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)


def test_a_flood_of_one_message_is_cut_to_the_burst(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("k3.infer.connection_limits.time.monotonic", lambda: now[0])
    limit = RateLimitFilter(burst=3, period_s=10.0)
    passed = [limit.filter(_record("socket.accept() out of system resource")) for _ in range(100_000)]
    assert sum(passed) == 3
    assert limit.filter(_record("another message"))  # other messages have their own budget
    now[0] = 11.0
    after = _record("socket.accept() out of system resource")
    assert limit.filter(after) and "99997 more like this" in after.msg


def test_prompt_characters_past_what_the_context_holds_are_refused():
    limits = ServerLimits(max_chars_per_token=4)
    check_prompt_chars(400, 100, limits)
    with pytest.raises(APIError, match="at most 400 characters") as caught:
        check_prompt_chars(401, 100, limits)
    assert caught.value.status == 400 and caught.value.param == "prompt"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerLimits(header_timeout_s=0)
