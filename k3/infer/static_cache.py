"""A preallocated (static) decode cache for K3 models, for one-token steps captured as CUDA graphs.

It keeps the interface the layers already use with HybridCache (per-layer slots; KDA: `state`, `conv_tails`,
`update`, and `state_in_place` / `update_conv_tails` for decode; MLA: `length`, `append`), but every tensor
lives at a fixed address for the cache's lifetime:

- KDA slot: the fp32 recurrent state [B, H, dk, dv] (advanced in place by the decode kernel) and the q/k/v conv
  tails side by side in one window [B, W-1, 3*H*dk], overwritten in place (`conv_tails` are its three views);
- MLA slot: latent [B, capacity, kv_lora_rank] and k_rope [B, capacity, qk_rope_head_dim] buffers, written at the
  device-side position, plus `visible_mask` [T, capacity] telling attention which slots are filled.

The write position is a 0-dim int64 tensor on the device shared by all slots, so advancing it needs no host
sync and is replayed by a graph. All rows of the batch share one position (batched decode of equal lengths).

Prefill long prompts into a HybridCache (its expanded attention path uses flash SDPA) and copy it in with
`StaticCache.from_hybrid`. Memory: KDA slots are constant in context length; MLA slots cost
(kv_lora_rank + qk_rope_head_dim) values per token of capacity.
"""

from __future__ import annotations

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
