"""Fixtures for the RL tests: a sandbox home per session (skipped, saying why, where k3 sandbox doctor finds a
required feature missing: root, namespaces, overlayfs, cgroups), and a tiny tokenizer + model."""

import os
import sys
from pathlib import Path

import pytest

# Python verifiers in these tests are named "tests.rl.verifiers:...": the repository root must be importable
# also when pytest is started as `pytest` rather than `python -m pytest`.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def sandbox_home(tmp_path_factory):
    from k3.sandbox.doctor import run_checks

    missing = [f"{c.name} ({c.detail})" for c in run_checks() if c.required and not c.ok]
    if missing:
        pytest.skip("the sandbox cannot run here: " + "; ".join(missing))
    home = str(tmp_path_factory.mktemp("k3-rl-sandbox-home"))
    previous = os.environ.get("K3_SANDBOX_HOME")
    os.environ["K3_SANDBOX_HOME"] = home
    yield home
    if previous is None:
        os.environ.pop("K3_SANDBOX_HOME", None)
    else:
        os.environ["K3_SANDBOX_HOME"] = previous


CHAT_TEXT = ('<|system|>Use python, then submit.\n<|user|>Compute 12+30.\n<|assistant|><tool_call>{"name": "python", '
             '"arguments": {"code": "print(12+30)"}}</tool_call><|tool|>42\n<|assistant|><tool_call>{"name": '
             '"submit", "arguments": {"answer": "42"}}</tool_call>')


@pytest.fixture(scope="session")
def tokenizer():
    from k3.data.tokenizer import train_bpe

    return train_bpe([CHAT_TEXT] * 20, 300, show_progress=False)


@pytest.fixture
def tiny_model(tokenizer):
    import torch

    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM

    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                 eos_token_id=tokenizer.eos_token_id)).eval()


@pytest.fixture
def step_clock(monkeypatch):
    """clocked(trainer, seconds): the training loop's clock then moves ``seconds`` with each of the trainer's steps
    and stands still otherwise, so a time budget stops after a known step count with no real timing."""
    from types import SimpleNamespace

    import k3.train.loop as loop_module

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    def clocked(trainer, seconds: float) -> None:
        step = trainer.train_step

        def timed_step():
            clock.now += seconds
            return step()

        monkeypatch.setattr(trainer, "train_step", timed_step)

    return clocked
