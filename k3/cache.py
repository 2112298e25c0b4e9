"""HybridCache: everything a K3 model needs to continue a batch of sequences.

Per KDA layer: the recurrent state S [B, H, dk, dv] (fp32) and the last (kernel-1) inputs of the q, k, v
short convs. Per MLA layer: the normalised latent c [B, T, kv_lora_rank] and the shared rope-key part
[B, T, qk_rope_head_dim], nothing else (the up-projections are absorbed at decode time).
AttnRes mixes are token-local over depth and need no cache.

KDA slots cost the same at any context length; MLA slots grow by (kv_lora_rank + qk_rope_head_dim) numbers
per token per layer.

The layers see a cache slot through KDASlot and MLASlot (typing.Protocol): HybridCache's slots here, the
engine's pool views (k3.infer.cache_pool) and the static decode cache (bench/static_decode.py). `in_place` and
`pages_in_place` say whether a slot's tensors stay where they are, so decode kernels advance them there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from k3.ops.mla_decode import PagedLatents


class StateSnapshot(NamedTuple):
    """Where a KDA layer also saves each row's state inside a forward (a prefix-cache boundary the forward runs
    through, so that no forward has to stop there): after the first at[b] of the row's tokens (at[b] = the row's
    whole length: nothing to save there); width = the longest rest (a host int: the second kernel call's length)."""

    at: torch.Tensor  # [B] int64
    width: int


@runtime_checkable
class KDASlot(Protocol):
    """A KDA layer's cache for a batch of rows: the fp32 recurrent state [B, H, dk, dv] and the q, k, v conv
    tails [B, W-1, C] (None before the first token)."""

    in_place: bool  # state_in_place, conv_window_in_place and update_conv_tails work: decode advances in place
    # [B] int64: how many of this forward's tokens are real in each row (the rest right padding, which must leave
    # the state and tails as they were), or None: all of them (k3.infer.runner's padded prefill).
    valid_lengths: torch.Tensor | None
    snapshot: StateSnapshot | None  # a state to save inside this forward (save_snapshot), or None

    @property
    def state(self) -> torch.Tensor | None: ...

    @property
    def conv_tails(self) -> tuple[torch.Tensor | None, ...]: ...

    @property
    def conv_window(self) -> torch.Tensor | None:
        """The three tails side by side [B, W-1, 3C] (the joined conv's layout), or None where kept apart."""

    def update(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None: ...

    def state_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state pool [slots, H, dk, dv] fp32, the rows' slots [B]) for fused_recurrent_kda_inplace."""

    def conv_window_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the window pool [slots, W-1, 3C], the rows' slots [B]) for short_conv_step_inplace."""

    def update_conv_tails(self, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None: ...

    def save_snapshot(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """Keep the rows' states and tails at `snapshot.at` (where a snapshot was asked for)."""


@runtime_checkable
class MLASlot(Protocol):
    """An MLA layer's cache for a batch of rows: the normalised latents and rope keys of the tokens so far."""

    pages_in_place: bool  # append_in_place works: decode attention reads the pages where they lie
    # After append: which of the returned positions each query sees ([T, S] or [B, 1, T, S]), and the same as
    # per-row limits [B]; None: causal from `length`.
    visible_mask: torch.Tensor | None
    visible_limits: torch.Tensor | None

    @property
    def length(self) -> int:
        """Tokens cached before this forward's (the host-side count the causal mask starts from)."""

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, T, R], k_rope [B, T, rope] -> the whole context's latents and rope keys [B, S, ...]."""

    def append_in_place(self, latent: torch.Tensor, k_rope: torch.Tensor) -> PagedLatents: ...


def _no_snapshots(slot: object) -> TypeError:
    return TypeError(f"{type(slot).__name__} saves no states inside a forward (its snapshot is None)")


def _not_in_place(slot: object) -> TypeError:
    return TypeError(f"{type(slot).__name__} grows by new tensors and has no in-place form; check its in_place / "
                     f"pages_in_place first")


class KDACacheSlot:
    in_place = False
    conv_window = None
    valid_lengths = None  # rows are never padded here
    snapshot = None  # nor saved inside a forward

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

    def state_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise _not_in_place(self)

    def conv_window_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise _not_in_place(self)

    def update_conv_tails(self, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        raise _not_in_place(self)

    def save_snapshot(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        raise _no_snapshots(self)


class MLACacheSlot:
    pages_in_place = False
    visible_mask = visible_limits = None  # causal from `length`

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

    def append_in_place(self, latent: torch.Tensor, k_rope: torch.Tensor) -> PagedLatents:
        raise _not_in_place(self)


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
