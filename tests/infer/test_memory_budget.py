"""The prefill sizes the engine takes from the device's free memory (k3.infer.memory_budget), with fake
free-memory numbers: where memory allows they are max_context's defaults; where not, they shrink to fit."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import ModelConfig
from k3.infer.cache_pool import CachePool, MLAView
from k3.infer.engine import default_prefill_chunk
from k3.infer.memory_budget import context_bytes, fit_prefill, prefill_bytes_per_token
from k3.ops.mla_decode import gather_pages

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


class _Created(TorchDispatchMode):
    """Every tensor an op makes: (shape, dtype)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(tuple(t.shape), t.dtype) for t in (out if isinstance(out, (tuple, list)) else [out])
                      if isinstance(t, torch.Tensor)]
        return out


def test_a_prefill_chunk_reads_only_its_rows_pages_and_makes_no_mask():
    """A prefill chunk after cached tokens: the layer attends over the row's tokens so far, gathered from the pages
    holding them (not the whole table, sized for max_context), and no [T, S] mask is made (the 1M eval on an 80 GB
    card failed on one: 49,152 queries x 1M slots, 48 GiB of booleans the causal SDPA call never read)."""
    config = ModelConfig.from_preset("debug")
    page, width = 16, 64  # a table for 1,024 tokens
    pool = CachePool(config, num_slots=1, num_pages=width, page_size=page, device="cpu", dtype=torch.float32)
    table, layer = torch.arange(1, width + 1)[None], config.layer_types.index("mla")
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    g = torch.Generator().manual_seed(0)
    past, length = 40, 24
    MLAView(pool, layer, table, torch.tensor([0]), mask_rows=False).append(
        torch.randn(1, past, rank, generator=g), torch.randn(1, past, rope, generator=g))
    view = MLAView(pool, layer, table, torch.tensor([past]), mask_rows=False, past=past)
    new_latent, new_rope = torch.randn(1, length, rank, generator=g), torch.randn(1, length, rope, generator=g)
    with _Created() as created:
        latent, k_rope = view.append(new_latent, new_rope)
    whole_latent, whole_rope, _ = gather_pages(view.pages(), length)  # the whole table, as before
    assert torch.equal(latent, whole_latent[:, :past + length]) and torch.equal(k_rope, whole_rope[:, :past + length])
    assert torch.equal(latent[:, past:], new_latent) and view.visible_mask is None
    assert not [made for made in created.made if made[1] == torch.bool or page * width in made[0]], created.made
    assert max(shape[1] for shape, _ in created.made if len(shape) == 3 and shape[-1] == rank) == 4 * page
