"""HybridCache: everything a K3 model needs to continue a batch of sequences.

Per KDA layer: the recurrent state S [B, H, dk, dv] (fp32) and the last (kernel-1) inputs of the q, k, v
short convs. Per MLA layer: the normalised latent c [B, T, kv_lora_rank] and the shared rope-key part
[B, T, qk_rope_head_dim], nothing else (the up-projections are absorbed at decode time).
AttnRes mixes are token-local over depth and need no cache.

KDA slots cost the same at any context length; MLA slots grow by (kv_lora_rank + qk_rope_head_dim) numbers
per token per layer.
"""

from __future__ import annotations

import torch


class KDACacheSlot:
    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.conv_tails: tuple[torch.Tensor | None, ...] = (None, None, None)

    def update(self, state: torch.Tensor, tails: tuple[torch.Tensor, ...]) -> None:
        self.state = state
        self.conv_tails = tails

    def nbytes(self) -> int:
        tensors = [self.state, *self.conv_tails]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def select(self, index: torch.Tensor) -> None:
        self.state = None if self.state is None else self.state[index]
        self.conv_tails = tuple(None if t is None else t[index] for t in self.conv_tails)


class MLACacheSlot:
    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None  # [B, T, R]
        self.k_rope: torch.Tensor | None = None  # [B, T, rope]

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latent is None:
            self.latent, self.k_rope = latent, k_rope
        else:
            self.latent = torch.cat([self.latent, latent], dim=1)
            self.k_rope = torch.cat([self.k_rope, k_rope], dim=1)
        return self.latent, self.k_rope

    def nbytes(self) -> int:
        tensors = [self.latent, self.k_rope]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def select(self, index: torch.Tensor) -> None:
        if self.latent is not None:
            self.latent, self.k_rope = self.latent[index], self.k_rope[index]


class HybridCache:
    """One slot per layer, in layer order; `seen_tokens` counts the tokens fed so far."""

    def __init__(self, layer_types: list[str], batch_size: int) -> None:
        self.batch_size = batch_size
        self.layers: list[KDACacheSlot | MLACacheSlot] = [
            MLACacheSlot() if t == "mla" else KDACacheSlot() for t in layer_types
        ]
        self.seen_tokens = 0

    def __getitem__(self, index: int) -> KDACacheSlot | MLACacheSlot:
        return self.layers[index]

    def nbytes(self, kind: str | None = None) -> int:
        """Bytes held, for all layers or only 'kda' / 'mla' ones."""
        return sum(slot.nbytes() for slot in self.layers
                   if kind is None or (kind == "mla") == isinstance(slot, MLACacheSlot))

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in `index` (e.g. drop finished sequences)."""
        for slot in self.layers:
            slot.select(index)
        self.batch_size = int(index.numel())
