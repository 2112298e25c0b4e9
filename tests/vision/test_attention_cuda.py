"""The flash varlen path (one call over the pack with cu_seqlens) equals the per-image SDPA oracle on a GPU."""

from __future__ import annotations

import pytest
import torch

from k3.vision.attention import cu_seqlens_from_grid, packed_attention
from vision_helpers import K3_TINY, K25_TINY, random_pixels, rel_err, tiny_vision

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("head_dim", [72, 128])
def test_varlen_equals_sdpa(head_dim):
    grid = torch.tensor([[1, 32, 32], [1, 6, 10], [4, 8, 8], [1, 2, 2]])
    n, heads = int(grid.prod(-1).sum()), 4
    q, k, v = (torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = cu_seqlens_from_grid(grid)
    fast, oracle = packed_attention(q, k, v, cu, "varlen"), packed_attention(q, k, v, cu, "sdpa")
    assert rel_err(fast.float(), oracle.float()) < 1e-2
    grads_fast = torch.autograd.grad(fast.float().square().sum(), (q, k, v))
    grads_oracle = torch.autograd.grad(oracle.float().square().sum(), (q, k, v))
    for a, b in zip(grads_fast, grads_oracle):
        assert rel_err(a.float(), b.float()) < 2e-2


@pytest.mark.parametrize("variant", [K3_TINY, K25_TINY], ids=["k3", "kimi-k2.5"])
def test_tower_varlen_bf16_matches_fp32_oracle(variant):
    oracle = tiny_vision(variant, num_layers=3)
    pixels, grid_thw = random_pixels([[1, 16, 12], [3, 4, 4], [1, 2, 2]])
    with torch.no_grad():
        reference = oracle(pixels, grid_thw)
        fast = oracle.to("cuda", torch.bfloat16)
        fast.attention_backend = "varlen"
        out = fast(pixels.cuda(), grid_thw).float().cpu()
    assert rel_err(out, reference) < 3e-2
