"""`k3 rl --sandbox-backend vm`: the fix suite on microVM sandboxes gives the same rollouts as on the local
backend (a small run, same seed; and scripted tool calls, observation for observation), and a machine without
usable KVM gets a clear error naming the local backend.

Slow: the guest boots once under TCG where there is no hardware KVM (a minute on 2 busy cores)."""

import json
import os
import shutil

import pytest
import torch

from k3.rl.chat_format import format_tool_call
from k3.rl.demos import write_demonstrations
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.sft import SFTConfig, SFTTrainer
from tests.rl.test_rollout import ScriptedEngine

pytestmark = pytest.mark.slow
TIMING = {"generation_s", "tool_s", "sandbox_setup_s", "verify_s", "rollout_tokens_per_s", "rollout_s", "train_s",
          "step_s", "sandbox_s"}


def _vm_missing() -> str | None:
    from k3.sandbox.vm.config import VmConfig, VmUnavailable, qemu_path

    try:
        qemu_path(VmConfig(accel="tcg").resolved())
    except VmUnavailable as error:
        return str(error)
    if shutil.which("mkfs.ext4") is None and shutil.which("mkfs.ext4", path="/sbin:/usr/sbin") is None:
        return "mkfs.ext4 is missing"
    return None


@pytest.fixture(scope="module")
def fix_start(sandbox_home, tokenizer, tmp_path_factory):
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM

    reason = _vm_missing()
    if reason:
        pytest.skip(f"no microVM here: {reason}")
    root = tmp_path_factory.mktemp("rl-vm-start")
    write_demonstrations("fix", 4, root / "demos.jsonl", show_progress=False)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                  eos_token_id=tokenizer.eos_token_id))
    SFTTrainer(SFTConfig(data=str(root / "demos.jsonl"), out=str(root / "sft"), steps=2, batch_size=4, device="cpu"),
               model=model, tokenizer=tokenizer, show_progress=False).train()
    return root / "sft"


def _config(start, out, backend):
    return RLConfig.flat(run=str(start), suite="fix", out=str(out), algo="grpo", group=2, tasks_per_step=1, steps=1,
                         lr=1e-2, heldout_every=100, heldout_tasks=0, save_every=100, device="cpu", max_context=1024,
                         temperature=1.0, threads=1, sandbox_backend=backend)


def _rollouts(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def test_fix_suite_on_vm_sandboxes_equals_the_local_backend(fix_start, tmp_path, monkeypatch):
    monkeypatch.setenv("K3_VM_ACCEL", "tcg")  # where KVM works this is slower, not different
    results = {}
    for backend in ("local", "vm"):
        trainer = RLTrainer(_config(fix_start, tmp_path / backend, backend), show_progress=False, log=lambda *_: None)
        try:
            trainer.train()
        finally:
            trainer.close()
        results[backend] = _rollouts(tmp_path / backend)
    step = results["vm"][-1]
    assert step["episodes"] == 2 and step["sandbox_failures"] == 0, step  # the verifier ran in each guest
    assert results["vm"] == results["local"]


def _fix_script(solution_of):
    """Sample 0 follows the suite's solution (run the tests, read, edit, run them again, submit); sample 1
    submits at once, unfixed (the first turn is the only one asked for two samples)."""
    def script(text, sample):
        turns = text.count("<|tool|>")
        steps = solution_of(text)
        if sample == 1:
            return format_tool_call("submit", {"answer": "gave up"})
        name, arguments = steps[min(turns, len(steps) - 1)]
        return format_tool_call(name, arguments)
    return script


def test_fix_suite_tool_calls_give_the_same_episodes_on_both_backends(fix_start, tokenizer, monkeypatch):
    from k3.rl.rollout import RolloutConfig, RolloutRunner
    from k3.rl.suites import get_suite

    monkeypatch.setenv("K3_VM_ACCEL", "tcg")
    suite = get_suite("fix")
    task = suite.task("train", 3)
    outcomes = {}
    for backend in ("local", "vm"):
        engine = ScriptedEngine(tokenizer, _fix_script(lambda text: suite.solution(task)))
        groups = RolloutRunner(engine, tokenizer, RolloutConfig(threads=1, max_context=4096, sandbox_backend=backend),
                               seed=0).run([task], group_size=2)
        outcomes[backend] = [(e.sample, e.finish, e.reward, e.tool_calls, e.sandbox_calls, e.tool_errors,
                              tokenizer.decode(e.ids)) for e in groups[0]]
    by_sample = {o[0]: o for o in outcomes["vm"]}
    assert by_sample[0][1:6] == ("submitted", 1.0, 5, 4, 1)  # fixed (the first test run fails: one tool error)
    assert by_sample[1][1:5] == ("submitted", 0.0, 1, 0), by_sample[1]  # not fixed: the verifier in the guest says so
    assert outcomes["vm"] == outcomes["local"]  # every observation, byte for byte


def test_no_usable_kvm_is_a_clear_error_naming_the_local_backend(fix_start, tmp_path, monkeypatch, capsys):
    from k3.cli import main
    from k3.sandbox.vm.config import VmUnavailable, kvm_problem

    if kvm_problem() is None:
        pytest.skip("this machine has usable KVM")
    monkeypatch.delenv("K3_VM_ACCEL", raising=False)
    with pytest.raises(VmUnavailable, match="no usable KVM.*local backend"):
        RLTrainer(_config(fix_start, tmp_path / "x", "vm"), show_progress=False, log=lambda *_: None)
    assert not os.path.exists(tmp_path / "x" / "metrics.jsonl")
    assert main(["rl", "--run", str(fix_start), "--suite", "fix", "--out", str(tmp_path / "y"), "--sandbox-backend",
                 "vm", "--device", "cpu"]) == 1
    assert "--sandbox-backend local" in capsys.readouterr().err
