"""Rollouts in real sandboxes: forked groups, failures that end only their episode, partial rollouts, and the
real engine driving a tiny model."""

import dataclasses
import os
import re
import signal
from types import SimpleNamespace

import pytest

import k3.rl.rollout as rollout_module
from k3.rl.chat_format import format_tool_call
from k3.rl.rollout import RolloutConfig, RolloutRunner
from k3.rl.tasks import EpisodeLimits, Task, Verifier


class ScriptedEngine:
    """Stands in for the policy: ``script(prompt_text, sample)`` gives each turn's text. Same interface as
    k3.infer.Engine.complete (one output per request, n completions each)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def complete(self, prompts, params):
        outputs = []
        for prompt, p in zip(prompts, params):
            text = self.tokenizer.decode(prompt)
            self.calls.append(p.n)
            completions = []
            for sample in range(p.n):
                ids = self.tokenizer.encode(self.script(text, sample)) + [self.tokenizer.eos_token_id]
                completions.append(SimpleNamespace(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop"))
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs


def make_task(task_id="t", verifier=None, **fields):
    return Task(id=task_id, prompt="Do it.", verifier=verifier or Verifier("answer", expected="ok"),
                limits=EpisodeLimits(turns=4, tokens_per_turn=512, total_tokens=4096, seconds=60), **fields)


def isolation_script(text, sample):
    turns = text.count("<|tool|>")
    if turns == 0:
        return format_tool_call("write_file", {"path": f"/work/mine_{sample}.txt", "content": str(sample)})
    if turns == 1:
        mine = re.search(r"/work/mine_(\d+)\.txt", text).group(1)
        return format_tool_call("bash", {"command": f"cat /work/state.txt; ls /work; cat /work/mine_{mine}.txt"})
    return format_tool_call("submit", {"answer": text.rsplit("<|tool|>", 1)[1].split("\n<|assistant|>")[0]})


def test_a_forked_group_sees_one_prepared_state_and_no_sibling_writes(sandbox_home, tokenizer, monkeypatch):
    prepared = []
    real_prepare = rollout_module.prepare_sandbox
    monkeypatch.setattr(rollout_module, "prepare_sandbox", lambda task, limits=None, backend="local":
                        prepared.append(task.id) or real_prepare(task, limits, backend))
    engine = ScriptedEngine(tokenizer, isolation_script)
    task = make_task(files={"/work/state.txt": "prepared\n"}, setup="echo setup-ran >> /work/state.txt")
    groups = RolloutRunner(engine, tokenizer, RolloutConfig(threads=4)).run([task], group_size=4)
    assert prepared == ["t"]  # one prepared sandbox for the whole group, forked 4 times
    assert engine.calls[0] == 4  # the first turn went to the engine as one request with n = 4
    episodes = groups[0]
    for episode in episodes:
        s = episode.sample
        assert episode.finish == "submitted" and episode.tool_calls == 3 and episode.sandbox_calls == 2
        # the prepared state (setup ran once, before the snapshot) and this episode's file only
        assert episode.answer.split() == ["prepared", "setup-ran", f"mine_{s}.txt", "state.txt", str(s)]
        assert len(episode.ids) == len(episode.mask) == len(episode.logprobs)
        assert all(lp == -1.0 for lp, m in zip(episode.logprobs, episode.mask) if m)
        assert episode.sandbox is None  # closed after verification


def test_without_setup_the_prepared_sandbox_is_one_episodes_and_the_rest_are_forks(sandbox_home, tokenizer,
                                                                                      monkeypatch):
    """A task prepared by files alone: its prepared sandbox serves the first episode (one sandbox start saved
    per group), and the group still sees one prepared state and no sibling's writes."""
    from k3.sandbox import Sandbox

    forks = []
    real_fork = Sandbox.fork
    monkeypatch.setattr(Sandbox, "fork", lambda self, snapshot=None, n=1: forks.append(n)
                        or real_fork(self, snapshot, n))
    task = make_task(files={"/work/state.txt": "prepared\n"})
    groups = RolloutRunner(ScriptedEngine(tokenizer, isolation_script), tokenizer,
                           RolloutConfig(threads=4)).run([task], group_size=4)
    assert forks == [3]
    for episode in groups[0]:
        assert episode.finish == "submitted"
        assert episode.answer.split() == ["prepared", f"mine_{episode.sample}.txt", "state.txt", str(episode.sample)]
        assert episode.sandbox is None
    single = RolloutRunner(ScriptedEngine(tokenizer, isolation_script), tokenizer).run([task], group_size=1)
    assert forks == [3] and single[0][0].answer.split() == ["prepared", "mine_0.txt", "state.txt", "0"]


def test_a_killed_sandbox_or_a_crashed_verifier_ends_only_its_episode(sandbox_home, tokenizer, monkeypatch):
    real_run_tool = rollout_module.run_tool

    def run_tool(call, sandbox, *args, **kwargs):
        if call.arguments.get("command") == "echo die":
            for pid in sandbox.pids():  # kill the sandbox from outside, as the OOM killer or an operator would
                os.kill(pid, signal.SIGKILL)
        return real_run_tool(call, sandbox, *args, **kwargs)

    monkeypatch.setattr(rollout_module, "run_tool", run_tool)

    def script(text, sample):
        if "<|tool|>" in text:
            return format_tool_call("submit", {"answer": "ok"})
        return format_tool_call("bash", {"command": "echo die" if sample == 0 else "echo fine"})

    crashing = make_task("crash", Verifier("python", function="tests.rl.verifiers:crash_on_ok"))
    tasks = [make_task("a"), crashing, make_task("b", setup="exit 3")]
    groups = RolloutRunner(ScriptedEngine(tokenizer, script), tokenizer).run(tasks, group_size=2)
    by_task = {g[0].task.id: g for g in groups}
    dead, alive = by_task["a"]
    assert dead.finish == "sandbox_died" and dead.failed and dead.reward == 0.0 and "died" in dead.reason
    assert alive.finish == "submitted" and alive.reward == 1.0
    assert all(e.reward == 0.0 and "verifier crashed: ZeroDivisionError" in e.reason for e in by_task["crash"]
               if e.sample == 1)
    assert all(e.finish == "sandbox_failed" and "setup command failed" in e.reason for e in by_task["b"])


def test_partial_rollouts_park_and_continue(sandbox_home, tokenizer):
    def script(text, sample):
        turns = text.count("<|tool|>")
        if turns < 2:
            return format_tool_call("bash", {"command": f"echo step{turns} >> /work/log.txt"})
        return format_tool_call("submit", {"answer": "ok"})

    runner = RolloutRunner(ScriptedEngine(tokenizer, script), tokenizer, RolloutConfig(iteration_token_budget=1))
    assert runner.run([make_task()], group_size=2) == []  # past the budget after one turn: parked
    assert len(runner.parked) == 1 and all(e.parked_snapshot and e.sandbox is None for e in runner.parked[0])
    groups = runner.run([], group_size=2)
    assert groups == []  # one more turn, parked again
    groups = runner.run([], group_size=2)
    (group,) = groups
    assert all(e.finish == "submitted" and e.reward == 1.0 and e.turns == 3 for e in group)
    # the restored sandbox kept the first iteration's writes
    assert not runner.parked


class BatchRecordingEngine(ScriptedEngine):
    """Also records how many episodes each batched engine call carried."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.batch_sizes = []

    def complete(self, prompts, params):
        self.batch_sizes.append(sum(p.n for p in params))
        return super().complete(prompts, params)


def test_heldout_scoring_runs_in_waves_of_at_most_max_live_episodes(sandbox_home, tokenizer):
    def script(text, sample):
        if "<|tool|>" in text:
            return format_tool_call("submit", {"answer": text.rsplit("<|tool|>", 1)[1].split("\n")[0]})
        return format_tool_call("bash", {"command": f"echo {text.count('Task')}-{sample}"})

    tasks = [dataclasses.replace(make_task(f"t{i}"), prompt="Task " * (i + 1)) for i in range(5)]
    everything = BatchRecordingEngine(tokenizer, script)
    at_once = RolloutRunner(everything, tokenizer).run_aside(tasks, 2, -1, 1.0)
    waves = BatchRecordingEngine(tokenizer, script)
    runner = RolloutRunner(waves, tokenizer, RolloutConfig(max_live_episodes=4))
    in_waves = runner.run_aside(tasks, 2, -1, 1.0)
    assert max(everything.batch_sizes) == 10 and max(waves.batch_sizes) == 4
    assert len(waves.batch_sizes) == 6  # 3 waves (2 + 2 + 1 tasks) x 2 turns
    assert [[e.answer for e in g] for g in in_waves] == [[e.answer for e in g] for g in at_once]
    assert [g[0].task.id for g in in_waves] == [t.id for t in tasks]
    assert in_waves[4][1].answer.startswith("5-1")
    # the waves' statistics add up
    assert runner.stats["generated_tokens"] == sum(e.model_tokens for g in in_waves for e in g)


def test_the_engine_and_a_tiny_model_run_calc_episodes(sandbox_home, tokenizer, tiny_model):
    from k3.rl.rollout_engine import build_engine
    from k3.rl.suites import get_suite

    engine = build_engine(tiny_model, tokenizer, max_context=1024)
    runner = RolloutRunner(engine, tokenizer, RolloutConfig(), seed=1)
    groups = runner.run(get_suite("calc").tasks("train", 2), group_size=3, step=1)
    assert [len(g) for g in groups] == [3, 3]
    for episode in (e for g in groups for e in g):
        assert episode.done and episode.reward in (0.0, 1.0) and not episode.failed
        assert len(episode.ids) == len(episode.mask) == len(episode.logprobs)
        assert sum(episode.mask) == episode.model_tokens > 0
        assert episode.model_tokens <= episode.task.limits.total_tokens
    assert runner.stats["generated_tokens"] > 0 and runner.stats["rollout_tokens_per_s"] > 0


def test_an_episode_limit_counts_its_own_tool_time_not_time_queued(sandbox_home, tokenizer, monkeypatch):
    """Each batched engine turn here takes 100 s of the clock (the episode waits for a long batch on a busy
    machine), far past the task's 60 s limit: the episode still finishes, since waiting is not its own time.
    Its own tool calls past the limit do end it."""
    import time

    clock = [time.perf_counter()]  # a clock that moves only with the engine (episodes start on the real one)
    monkeypatch.setattr(rollout_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class SlowBatchEngine(ScriptedEngine):
        def complete(self, prompts, params):
            clock[0] += 100.0
            return super().complete(prompts, params)

    def script(text, sample):
        if text.count("<|tool|>") < 2:
            return format_tool_call("bash", {"command": "echo hi"})
        return format_tool_call("submit", {"answer": "ok"})

    (group,) = RolloutRunner(SlowBatchEngine(tokenizer, script), tokenizer).run([make_task()], group_size=2)
    assert all(e.finish == "submitted" and e.reward == 1.0 and e.turns == 3 for e in group)
    assert all(e.seconds > 250 for e in group)  # the wall time it took is still reported
    real_run_tool = rollout_module.run_tool

    def slow_tool(*args, **kwargs):
        return dataclasses.replace(real_run_tool(*args, **kwargs), seconds=35.0)

    monkeypatch.setattr(rollout_module, "run_tool", slow_tool)
    (group,) = RolloutRunner(ScriptedEngine(tokenizer, script), tokenizer).run([make_task()], group_size=2)
    assert all(e.finish == "time" and e.turns == 2 and e.reward == 0.0 for e in group)
