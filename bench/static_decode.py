"""A second decode path, for benchmarks and tests only: a preallocated (static) cache and a one-token step over it,
eager, compiled, or captured once and replayed as a CUDA graph. The engine decodes through its own runner
(k3.infer.runner over the cache pool); bench/decode.py times this bare step against peers, and the tests use it
as a second in-place cache (k3.cache.KDASlot / MLASlot) and as the smallest compiled step.

The cache. Its slots are k3.cache.KDASlot / MLASlot, as HybridCache's are, but every tensor lives at a fixed
address for the cache's lifetime:

- KDA slot: the fp32 recurrent state [B, H, dk, dv] (advanced in place by the decode kernel) and the q/k/v conv
  tails side by side in one window [B, W-1, 3*H*dk], overwritten in place (`conv_tails` are its three views);
- MLA slot: latent [B, capacity, kv_lora_rank] and k_rope [B, capacity, qk_rope_head_dim] buffers, written at the
  device-side position, plus `visible_mask` [T, capacity] telling attention which slots are filled.

The write position is a 0-dim int64 tensor on the device shared by all slots, so advancing it needs no host
sync and is replayed by a graph. All rows of the batch share one position (batched decode of equal lengths).

Prefill long prompts into a HybridCache (its expanded attention path uses flash SDPA) and copy it in with
`StaticCache.from_hybrid`. Memory: KDA slots are constant in context length; MLA slots cost
(kv_lora_rank + qk_rope_head_dim) values per token of capacity.

The step. One-token decode over a StaticCache, eager or captured once and replayed as a CUDA graph.

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

from k3.cache import HybridCache, KDACacheSlot, MLACacheSlot
from k3.config import ModelConfig


class StaticKDASlot:
    """KDA state and conv tails at fixed addresses; `update` copies into them, and decode advances the state
    in its own buffer (`state_in_place`: row i is slot i) without the copy.

    The three tails live side by side in one window [B, W-1, 3C], the layout of the layer's joined q/k/v conv:
    a decode step reads it as it is and writes it back with one copy, where three buffers took a concatenation
    going in and three copies coming out (small kernels, one set per KDA layer and step)."""

    in_place = True
    valid_lengths = None  # decode only: no padded rows
    snapshot = None  # nor states saved inside a forward

    def __init__(self, config: ModelConfig, batch_size: int, device: torch.device, dtype: torch.dtype) -> None:
        heads, dim = config.kda_num_heads, config.kda_head_dim
        self.width = heads * dim
        self.state = torch.zeros(batch_size, heads, dim, dim, dtype=torch.float32, device=device)
        self.conv_window = torch.zeros(batch_size, config.kda_conv_kernel - 1, 3 * self.width, dtype=dtype,
                                       device=device)
        # Made once: a CUDA graph captures its address, and a step allocates nothing.
        self.rows = torch.arange(batch_size, device=device)

    @property
    def conv_tails(self) -> tuple[torch.Tensor, ...]:
        """The q, k and v tails [B, W-1, C]: views of the window."""
        return tuple(self.conv_window.split(self.width, dim=-1))

    def state_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state buffer [B, H, dk, dv] fp32 as the pool, rows [B] = 0..B-1) for
        k3.ops.kda.fused_recurrent_kda_inplace."""
        return self.state, self.rows

    def conv_window_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the window buffer [B, W-1, 3C] as the pool, rows [B] = 0..B-1) for
        k3.ops.conv_step_triton.short_conv_step_inplace."""
        return self.conv_window, self.rows

    def update(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        self.state.copy_(state)
        self.update_conv_tails(tails)

    def save_snapshot(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        raise TypeError("StaticKDASlot saves no states inside a forward (its snapshot is None)")

    def update_conv_tails(self, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """tails: the joined window [B, W-1, 3C] (one copy) or the three tails [B, W-1, C]."""
        if isinstance(tails, torch.Tensor):
            self.conv_window.copy_(tails)
            return
        for buffer, tail in zip(self.conv_tails, tails, strict=True):
            buffer.copy_(tail)

    def buffers(self) -> list[torch.Tensor]:
        return [self.state, self.conv_window]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


class StaticMLASlot:
    """Latent and rope-key buffers of fixed capacity, written at the shared device-side position."""

    pages_in_place = False  # a contiguous buffer, not pages: attention reads it by visible_mask

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int, position: torch.Tensor,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.latent = torch.zeros(batch_size, capacity, config.kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(batch_size, capacity, config.qk_rope_head_dim, dtype=dtype, device=device)
        self.position = position
        self.slots = torch.arange(capacity, device=device)
        self.visible_mask: torch.Tensor | None = None
        self.visible_limits: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """The filled length lives on the device (`position`); attention reads `visible_mask` instead, so
        this host-side value is never used for masking and is 0."""
        return 0

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, T, R], k_rope [B, T, rope] -> the whole buffers; sets visible_mask [T, capacity] and the
        same visibility as visible_limits [B] (query t of row b sees slots < limits[b] + t: the MLA decode
        kernel's form, with which it skips the unfilled capacity)."""
        index = self.position + torch.arange(latent.shape[1], device=latent.device)
        self.latent.index_copy_(1, index, latent.to(self.latent.dtype))
        self.k_rope.index_copy_(1, index, k_rope.to(self.k_rope.dtype))
        self.visible_mask = self.slots[None, :] <= index[:, None]
        self.visible_limits = (self.position + 1).to(torch.int32).expand(latent.shape[0])
        return self.latent, self.k_rope

    def append_in_place(self, latent: torch.Tensor, k_rope: torch.Tensor):
        raise TypeError("StaticMLASlot keeps a contiguous buffer, not pages; use append (pages_in_place is False)")

    def buffers(self) -> list[torch.Tensor]:
        return [self.latent, self.k_rope]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


class StaticCache:
    """Per-layer static slots in layer order; `position` [] int64 counts the tokens written so far."""

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity is the most tokens the cache will hold and must be >= 1, got {capacity}")
        device = torch.device(device)
        self.batch_size = batch_size
        self.capacity = capacity
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.layers: list[StaticKDASlot | StaticMLASlot] = [
            StaticMLASlot(config, batch_size, capacity, self.position, device, dtype) if kind == "mla"
            else StaticKDASlot(config, batch_size, device, dtype) for kind in config.layer_types
        ]

    def __getitem__(self, index: int) -> StaticKDASlot | StaticMLASlot:
        return self.layers[index]

    def advance(self, num_tokens: int) -> None:
        """Move the write position on by num_tokens (a device op: no sync, replayable in a graph)."""
        self.position.add_(num_tokens)

    def nbytes(self, kind: str | None = None) -> int:
        """Bytes held, for all layers or only 'kda' / 'mla' ones (MLA counts the full capacity)."""
        return sum(slot.nbytes() for slot in self.layers
                   if kind is None or (kind == "mla") == isinstance(slot, StaticMLASlot))

    def recurrent_buffers(self) -> list[torch.Tensor]:
        """The tensors a step overwrites in place (KDA states and tails, the position); MLA buffers are only
        written past the position, so saving these is enough to undo a step."""
        out = [self.position]
        for slot in self.layers:
            if isinstance(slot, StaticKDASlot):
                out.extend(slot.buffers())
        return out

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.recurrent_buffers()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for buffer, value in zip(self.recurrent_buffers(), saved):
            buffer.copy_(value)

    @classmethod
    def from_hybrid(cls, config: ModelConfig, cache: HybridCache, capacity: int,
                    dtype: torch.dtype | None = None) -> "StaticCache":
        """Copy a prefilled HybridCache (every layer run at least once) into a new static cache."""
        if cache.seen_tokens > capacity:
            raise ValueError(f"the cache holds {cache.seen_tokens} tokens but capacity is only {capacity}")
        first = next((s for s in cache.layers if isinstance(s, MLACacheSlot) and s.latent is not None), None)
        reference = first.latent if first is not None else next(
            s.conv_tails[0] for s in cache.layers if isinstance(s, KDACacheSlot) and s.state is not None)
        static = cls(config, cache.batch_size, capacity, reference.device, dtype or reference.dtype)
        for source, target in zip(cache.layers, static.layers):
            if isinstance(source, KDACacheSlot):
                if source.state is None:
                    raise ValueError("from_hybrid needs a prefilled cache; a KDA layer has no state yet")
                target.update(source.state, source.conv_tails)
            else:
                target.latent[:, : source.length].copy_(source.latent)
                target.k_rope[:, : source.length].copy_(source.k_rope)
        static.position.fill_(cache.seen_tokens)
        return static

@torch.no_grad()
def decode_step(model, cache: StaticCache, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, 1] -> logits [B, V] for the next token; writes the token into `cache` and advances it."""
    hidden = model.model(input_ids, cache)
    logits = model.lm_head(hidden[:, -1])
    cache.advance(input_ids.shape[1])
    return logits


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
