"""Every host-side call has a deadline: one hostile way to hold a call per test, each against it.

Each test runs the call in a thread with a bound well above its deadline, so a call that would
block forever fails the test instead of hanging the suite.
"""

import threading
import time

import pytest

from k3.sandbox.local import SandboxError


def _within(seconds: float, fn):
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the host call did not return within {seconds} s"
    return outcome


def _mkfifo(box, path: str) -> None:
    assert box.exec(["python3", "-c", f"import os; os.mkfifo({path!r})"]).ok  # the image has no mkfifo(1)


def _only_pid1_left(box, seconds: float = 10.0) -> list[int]:
    """Pids of the sandbox's cgroup beyond unshare and PID 1, after waiting up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        extra = box.pids()[2:]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


def test_a_command_that_stops_its_manager_returns_at_its_timeout(box):
    outcome = _within(30, lambda: box.exec("kill -STOP $PPID; sleep 1000", timeout=2))
    if "value" in outcome:
        assert outcome["value"].timed_out
    else:
        assert isinstance(outcome["error"], SandboxError), outcome["error"]
    assert _only_pid1_left(box) == []


def test_a_command_that_kills_its_manager_does_not_outlive_the_call(box):
    outcome = _within(30, lambda: box.exec("kill -9 $PPID; while :; do :; done", timeout=2))
    assert "error" in outcome or outcome["value"].timed_out or not outcome["value"].ok
    assert _only_pid1_left(box) == []
    assert box.exec("echo alive").stdout == "alive\n"


def test_read_file_of_a_fifo_fails_at_once(box):
    _mkfifo(box, "/tmp/pipe")
    outcome = _within(20, lambda: box.read_file("/tmp/pipe"))
    assert isinstance(outcome.get("error"), OSError), outcome
    assert "regular file" in str(outcome["error"])


def test_write_file_to_a_fifo_fails_at_once(box):
    _mkfifo(box, "/tmp/pipe")
    outcome = _within(20, lambda: box.write_file("/tmp/pipe", b"data"))
    assert isinstance(outcome.get("error"), OSError), outcome


def test_a_sleeping_command_is_killed_at_its_timeout(box):
    started = time.monotonic()
    outcome = _within(30, lambda: box.exec("sleep 1000 & sleep 1000", timeout=1))
    assert outcome["value"].timed_out
    assert time.monotonic() - started < 15
    assert _only_pid1_left(box) == []


def test_a_repl_that_stops_itself_cannot_hold_the_next_call(box):
    repl = box.repl()
    # A thread stops the whole REPL process just after the cell has answered.
    repl.run("import os, signal, threading, time\n"
             "threading.Thread(target=lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGSTOP))).start()")
    time.sleep(1.0)
    big_cell = "x = 1\n" + "#" * (1 << 20)  # more than a pipe holds: writing it blocks on a stopped reader
    outcome = _within(30, lambda: repl.run(big_cell, timeout=2))
    if "value" in outcome:
        assert outcome["value"].timed_out or outcome["value"].died
    else:
        assert isinstance(outcome["error"], SandboxError), outcome["error"]


def test_a_host_call_the_sandbox_never_answers_is_cut_at_its_deadline(box, monkeypatch):
    # PID 1 busy past every deadline stands for any way the sandbox could stop answering.
    from k3.sandbox import api

    monkeypatch.setattr(api, "FILE_TIMEOUT_S", 1.0)
    box._supervisor._send({"op": "exec", "argv": ["/bin/sleep", "1000"], "env": {}, "cwd": "/", "timeout": None,
                           "stdin": None, "max_output": 10})  # PID 1 now waits on this command
    started = time.monotonic()
    outcome = _within(30, lambda: box.read_file("/etc/hostname"))
    assert isinstance(outcome.get("error"), SandboxError), outcome
    assert time.monotonic() - started < 15
    deadline = time.monotonic() + 10
    while box.pids() and time.monotonic() < deadline:  # the whole sandbox was killed, PID 1 included
        time.sleep(0.05)
    assert box.pids() == []
