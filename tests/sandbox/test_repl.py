"""The persistent Python REPL of a sandbox: state across calls, per-call output, timeouts, limits."""

import pytest

from k3.sandbox import Limits, Sandbox


def test_variables_functions_and_classes_survive_across_calls(box):
    repl = box.repl()
    assert repl.run("x = 20\ndef inc(v, by=1):\n    return v + by\nclass Box:\n    size = 2").ok
    result = repl.run("inc(x, by=Box.size)")
    assert result.ok and result.value == "22"


def test_output_is_captured_per_call(box):
    repl = box.repl()
    first = repl.run("print('one')")
    second = repl.run("import sys, subprocess\nprint('two')\nprint('err', file=sys.stderr)\nsubprocess.run(['echo', 'sub'])")
    assert first.stdout == "one\n"
    assert second.stdout == "two\nsub\n" and second.stderr == "err\n"


def test_an_exception_is_reported_and_the_repl_lives_on(box):
    repl = box.repl()
    repl.run("kept = 'yes'")
    result = repl.run("1 / 0")
    assert result.error == "ZeroDivisionError: division by zero" and "ZeroDivisionError" in result.stderr
    assert repl.run("kept").value == "'yes'"


def test_a_hung_cell_times_out_and_keeps_the_state(box):
    repl = box.repl()
    repl.run("kept = 41")
    result = repl.run("import time\nwhile True:\n    time.sleep(0.05)", timeout=0.5)
    assert result.timed_out and not result.died
    assert repl.run("kept + 1").value == "42"


def test_a_cell_that_ignores_the_interrupt_kills_only_the_repl(box):
    repl = box.repl()
    repl.run("kept = 1")
    result = repl.run("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.05)",
                      timeout=0.3)
    assert result.timed_out and result.died
    assert box.exec("echo alive").stdout == "alive\n"  # the sandbox is untouched
    fresh = repl.run("'kept' in dir()")
    assert fresh.ok and fresh.value == "False"  # a new interpreter, as documented


def test_a_cell_that_exits_does_not_end_the_repl(box):
    repl = box.repl()
    repl.run("kept = 3")
    assert repl.run("raise SystemExit(4)").error.startswith("SystemExit")
    assert repl.run("kept").value == "3"


def test_repls_are_named_and_separate(box):
    box.repl("a").run("v = 'a'")
    box.repl("b").run("v = 'b'")
    assert box.repl("a").run("v").value == "'a'" and box.repl("b").run("v").value == "'b'"
    with pytest.raises(ValueError, match="REPL name"):
        box.repl("no spaces")


def test_a_repl_past_the_memory_limit_is_killed_and_the_host_is_unharmed(sandbox_home):
    with Sandbox(limits=Limits(memory_mb=64)) as box:
        repl = box.repl()
        result = repl.run("hog = []\nwhile True:\n    hog.append(bytearray(8 << 20))", timeout=60)
        assert result.died and result.oom_killed
        assert box.exec("echo alive").stdout == "alive\n"
        assert repl.run("1 + 1").value == "2"  # a fresh REPL within the same limit
        assert box.memory_bytes() < 64 << 20


def test_restore_without_memory_starts_a_fresh_repl(box):
    repl = box.repl()
    repl.run("x = 5")
    box.restore(box.snapshot())
    assert not repl.alive
    assert repl.run("'x' in dir()").value == "False"


CELLS = ["import json, sys\nrows = [{'a': i} for i in range(3)]", "print(json.dumps(rows))", "sum(r['a'] for r in rows)",
         "sys.path[0] == '' or isinstance(sys.path, list)", "undefined_name", "import os\nos.getcwd()"]


def _transcript(box):
    out = []
    for cell in CELLS:
        result = box.repl().run(cell)
        out.append((result.stdout, result.value, result.error))
    return out


def test_the_fork_of_pid_1_and_a_started_python3_give_the_same_repl(sandbox_home, monkeypatch):
    from k3.sandbox import repl as repl_module

    with Sandbox() as forked:
        assert repl_module.image_runs_supervisor_python(forked.image.path)  # the default image: fork path
        fast = _transcript(forked)
    monkeypatch.setattr(repl_module, "image_runs_supervisor_python", lambda path: False)
    with Sandbox() as started:
        slow = _transcript(started)
    assert fast == slow


def test_the_repl_holds_no_capability_and_no_descriptor_of_pid_1(box):
    result = box.repl().run("import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
                            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm', 'CapBnd'))])\n"
                            "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])")
    fds, caps, no_new_privs = result.stdout.splitlines()
    assert eval(fds) == [0, 1, 2, 3, 4, 5]  # stdin, out, err, the two REPL pipes, and listdir's own
    assert set(eval(caps)) == {"0000000000000000"} and no_new_privs == "1"
