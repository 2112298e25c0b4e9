"""K3_AUTOTUNE_CONFIGS: the CLI, benches and GPU test runs keep at most N of a triton.autotune's configs (evenly
spaced), and a bad value is refused with the reason. Only the decorator's config list is checked: nothing
compiles."""

from __future__ import annotations

import pytest
import torch
import triton

from k3.ops import triton_support


@pytest.fixture
def restore_autotune():
    """Start from Triton's own decorator (a GPU test run has already limited it, tests/conftest.py) and put back
    whatever was there."""
    before = triton.autotune
    triton.autotune = getattr(before, "_k3_original", before)
    yield
    triton.autotune = before


def _kept(configs: int) -> list[int]:
    """The num_warps values of the configs an autotune declared now keeps (each config tagged by its index)."""
    @triton.autotune(configs=[triton.Config({}, num_warps=i + 1) for i in range(configs)], key=["n"])
    @triton.jit
    def kernel(n):
        pass
    return [c.num_warps - 1 for c in kernel.configs]


@pytest.mark.parametrize("name", ["K3_AUTOTUNE_CONFIGS", "K3_BENCH_AUTOTUNE_CONFIGS"])
def test_env_keeps_evenly_spaced_configs_on_a_gpu(monkeypatch, restore_autotune, name):
    monkeypatch.delenv("K3_AUTOTUNE_CONFIGS", raising=False)
    monkeypatch.delenv("K3_BENCH_AUTOTUNE_CONFIGS", raising=False)
    monkeypatch.setenv(name, "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_support.limit_triton_autotune_from_env()
    assert _kept(12) == [0, 3, 6, 9]
    assert _kept(3) == [0, 1, 2]  # fewer than N: all of them


def test_nothing_changes_without_the_env_or_a_gpu(monkeypatch, restore_autotune):
    monkeypatch.delenv("K3_AUTOTUNE_CONFIGS", raising=False)
    monkeypatch.delenv("K3_BENCH_AUTOTUNE_CONFIGS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_support.limit_triton_autotune_from_env()
    assert _kept(12) == list(range(12))
    monkeypatch.setenv("K3_AUTOTUNE_CONFIGS", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    triton_support.limit_triton_autotune_from_env()
    assert _kept(12) == list(range(12))


@pytest.mark.parametrize("value", ["0", "four", "-2"])
def test_a_bad_value_is_refused(monkeypatch, value):
    monkeypatch.setenv("K3_AUTOTUNE_CONFIGS", value)
    with pytest.raises(ValueError, match="K3_AUTOTUNE_CONFIGS must be a whole number"):
        triton_support.autotune_configs_from_env()


def test_the_cli_applies_it_before_running_a_command(monkeypatch):
    import k3.cli

    calls = []
    monkeypatch.setattr(triton_support, "limit_triton_autotune_from_env", lambda: calls.append(1))
    assert k3.cli.main(["info", "--preset", "debug", "--json"]) == 0
    assert calls == [1]
