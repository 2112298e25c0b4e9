"""One-token decode over a StaticCache, eager or captured once and replayed as a CUDA graph.

`decode_step` is the plain step (any device): embed -> layers -> norm -> LM head on the last position, then the
cache's device-side position moves on by one. It skips K3ForCausalLM.forward's input checks, which read token
ids back to the host and so cannot be captured.

`compiled_decode_step()` is the same step through torch.compile (inductor) as one graph: no graph breaks
(fla's kernels enter as k3:: custom ops, see k3.ops.fused_backend) and static shapes. Inductor fuses the
elementwise glue between the GEMMs and fla kernels (casts, norms, router and AttnRes arithmetic, cache writes),
so a captured step holds far fewer kernels.

`CUDAGraphDecoder` warms the step up on a side stream (fla autotuning, torch.compile: with compile=True the
first warm-up step compiles), puts the cache back as it was, captures one step, and then replays it: the
whole model step is one graph launch. `greedy` also keeps sampling on the device (argmax written straight into
the graph's input), so a run of steps has no host sync.
"""

from __future__ import annotations

import functools
import time

import torch

from k3 import kernels
from k3.infer.static_cache import StaticCache


@torch.no_grad()
def decode_step(model, cache: StaticCache, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, 1] -> logits [B, V] for the next token; writes the token into `cache` and advances it."""
    hidden = model.model(input_ids, cache)
    logits = model.lm_head(hidden[:, -1])
    cache.advance(input_ids.shape[1])
    return logits


def compile_decode_from_env() -> bool:
    """K3_COMPILE_DECODE=1 turns the compiled decode step on where the engine captures its graphs (default 0)."""
    return kernels.enabled("compile_decode")


@functools.lru_cache(maxsize=1)
def compiled_decode_step():
    """decode_step through torch.compile: fullgraph (a graph break raises instead of splitting the step) and
    static shapes (each model, batch size and cache capacity compiles once, on its first call)."""
    return torch.compile(decode_step, fullgraph=True, dynamic=False)


class CUDAGraphDecoder:
    """A captured decode step over `cache`. `step(ids [B, 1]) -> logits [B, V]` (a view of the graph's static
    output: copy it before the next step if you keep it); `greedy(first [B, 1], n) -> tokens [B, n]`.
    compile=True captures compiled_decode_step() instead of the eager step; `warmup_s` is the first warm-up
    step's wall time (with compile, mostly the compile)."""

    def __init__(self, model, cache: StaticCache, warmup_steps: int = 3, compile: bool = False) -> None:
        if not cache.position.is_cuda:
            raise RuntimeError("CUDAGraphDecoder needs a StaticCache on a CUDA device; use decode_step elsewhere")
        self.model, self.cache = model, cache
        self.step_fn = compiled_decode_step() if compile else decode_step
        self.input_ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.position.device)
        saved = cache.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        self.warmup_s = float("nan")
        with torch.cuda.stream(side):
            for i in range(warmup_steps):
                start = time.perf_counter()
                self._step()
                if i == 0:
                    side.synchronize()
                    self.warmup_s = time.perf_counter() - start
        torch.cuda.current_stream().wait_stream(side)
        cache.restore(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()
            self.next_ids = self.logits.argmax(-1, keepdim=True)

    def _step(self) -> torch.Tensor:
        return self.step_fn(self.model, self.cache, self.input_ids)

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return self.logits

    @torch.no_grad()
    def greedy(self, first_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Feed first_ids [B, 1], then each argmax; returns the num_tokens greedy tokens [B, num_tokens]."""
        tokens = torch.empty(self.cache.batch_size, num_tokens, dtype=torch.long, device=self.input_ids.device)
        self.input_ids.copy_(first_ids)
        for i in range(num_tokens):
            self.graph.replay()
            tokens[:, i].copy_(self.next_ids[:, 0])
            self.input_ids.copy_(self.next_ids)
        return tokens
