"""The prefill sizes the engine takes from the device's free memory (k3.infer.memory_budget), with fake
free-memory numbers: where memory allows they are max_context's defaults; where not, they shrink to fit."""

import pytest

from k3.config import ModelConfig
from k3.infer.engine import default_prefill_chunk
from k3.infer.memory_budget import context_bytes, fit_prefill, prefill_bytes_per_token

GiB = 2**30
SMALL = ModelConfig.from_preset("small")


def test_a_large_device_keeps_the_defaults():
    chunk, step = default_prefill_chunk(1 << 20, on_gpu=True)
    fit = fit_prefill(SMALL, 1 << 20, chunk, step, free_bytes=10_000 * GiB, itemsize=2)
    assert (fit.chunk, fit.step_tokens) == (chunk, step) == (65536, 262144)


def test_an_80gb_device_at_1m_gets_a_step_that_fits():
    chunk, step = default_prefill_chunk(1 << 20, on_gpu=True)
    free = 70 * GiB  # an H100 after `small`'s weights and a 1M-token cache pool
    fit = fit_prefill(SMALL, 1 << 20, chunk, step, free_bytes=free, itemsize=2)
    assert fit.step_tokens < step and fit.chunk <= chunk
    assert fit.chunk % 2048 == 0 and fit.step_tokens % 2048 == 0
    # The estimate of the largest forward, fixed context cost included, is within the budget.
    assert fit.context_bytes + fit.step_tokens * fit.bytes_per_token <= fit.budget_bytes <= 0.6 * free
    assert fit.context_bytes + fit.chunk * fit.bytes_per_token <= fit.budget_bytes


def test_less_free_memory_never_gives_a_longer_chunk():
    chunk, step = default_prefill_chunk(1 << 20, on_gpu=True)
    fits = [fit_prefill(SMALL, 1 << 20, chunk, step, free_bytes=g * GiB, itemsize=2) for g in (200, 80, 40, 20, 10)]
    assert all(a.chunk >= b.chunk and a.step_tokens >= b.step_tokens for a, b in zip(fits, fits[1:]))
    assert fits[0].chunk > fits[-1].chunk


def test_a_device_too_small_still_gets_one_quantum_not_zero():
    fit = fit_prefill(SMALL, 1 << 20, 65536, 262144, free_bytes=1 * GiB, itemsize=2)
    assert fit.chunk == fit.step_tokens == 2048
    short = fit_prefill(SMALL, 4096, 512, 2048, free_bytes=0, itemsize=2)
    assert short.chunk == 512 and short.step_tokens == 512  # never longer than asked


def test_the_context_cost_grows_with_the_context_and_fp32_costs_more():
    assert context_bytes(SMALL, 1 << 20, 2) == 8 * context_bytes(SMALL, 1 << 17, 2) > 0
    assert prefill_bytes_per_token(SMALL, 4) > prefill_bytes_per_token(SMALL, 2)
    fp32 = fit_prefill(SMALL, 1 << 20, 65536, 262144, free_bytes=60 * GiB, itemsize=4)
    bf16 = fit_prefill(SMALL, 1 << 20, 65536, 262144, free_bytes=60 * GiB, itemsize=2)
    assert fp32.step_tokens < bf16.step_tokens


@pytest.mark.parametrize("kwargs", [dict(fraction=0), dict(fraction=1.5), dict(free_bytes=-1), dict(chunk=0)])
def test_bad_arguments_say_what_is_wrong(kwargs):
    args = dict(config=SMALL, max_context=4096, chunk=512, step_tokens=2048, free_bytes=GiB, itemsize=2) | kwargs
    with pytest.raises(ValueError, match="must be"):
        fit_prefill(**args)
