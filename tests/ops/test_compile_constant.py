"""k3.ops.compile_constant: torch.compile's constant-result mark, set without importing torch._dynamo, so that
importing the model stays ~1.5 s lighter."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from k3.ops.compile_constant import assume_constant_result


def test_the_mark_is_the_one_torch_sets():
    def ours():
        return True

    def torchs():
        return True

    assert assume_constant_result(ours) is ours
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) and vars(ours)


def _imported() -> bool:
    return importlib.import_module("json") is not None  # dynamo cannot trace this


def _compiled_with(check):
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if check() else x - 1
    torch._dynamo.reset()
    return torch.compile(step, fullgraph=True, backend="eager")


def test_a_marked_function_is_a_constant_in_one_graph():
    calls = []

    @assume_constant_result
    def marked() -> bool:
        calls.append(1)
        return _imported()

    def unmarked() -> bool:
        return _imported()

    # the control: traced, the body breaks the one graph that fullgraph demands
    with pytest.raises(torch._dynamo.exc.Unsupported, match="import_module"):
        _compiled_with(unmarked)(torch.zeros(2))
    step = _compiled_with(marked)
    assert torch.equal(step(torch.zeros(2)), torch.ones(2))
    assert torch.equal(step(torch.zeros(2)), torch.ones(2))
    assert len(calls) == 1  # called once while tracing, its result kept in the graph


def test_importing_k3_does_not_import_dynamo_or_dtensor():
    # One interpreter for the three entry points (each a fresh one cost ~4 s): after each import, whether dynamo
    # (~1.5 s) and torch.distributed.tensor (~0.9 s) came; the trainer may load the latter (its FSDP path needs it).
    code = ("import importlib, sys\n"
            "for module in ('k3.model', 'k3.infer.engine', 'k3.train.trainer'):\n"
            "    importlib.import_module(module)\n"
            "    print(module, 'torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert [rows[m][0] for m in ("k3.model", "k3.infer.engine", "k3.train.trainer")] == ["False"] * 3, result.stdout
    assert [rows[m][1] for m in ("k3.model", "k3.infer.engine")] == ["False"] * 2, result.stdout
