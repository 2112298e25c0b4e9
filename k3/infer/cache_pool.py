"""The engine's memory: a fixed pool of KDA state slots and a paged MLA latent cache, shared by all requests.

- KDA layers keep, per request, one *slot*: the fp32 recurrent state [H, dk, dv] and the three conv tails
  [W-1, H*dk] of every KDA layer, stacked over layers so a slot is copied (fork, prefix snapshot) in one op.
  Its size does not depend on the context length. A slot is zeroed when it is handed out.
- MLA layers keep the normalised latent and the rope key of every token, in fixed-size *pages* of `page_size`
  tokens; a request holds a page table (list of page ids). Full pages of a prompt can be shared between
  requests (prefix caching, forks): pages are reference counted, and a shared page is never written again
  because a request only writes at positions past its shared prefix.

Slot 0 and page 0 are scratch: padded rows of a CUDA-graph batch read and write there, so real slots and
pages never see them.

`BatchCache` is the view a forward takes: `cache[i]` is layer i's adapter, a k3.cache.KDASlot / MLASlot as
HybridCache's slots are (in place: decode advances KDA states and reads MLA pages where they lie). It gathers the rows' slots
and pages, and scatters what the layer writes back into the pool (a decode step's KDA states are advanced in the
pool itself, and its MLA attention reads the pages where they lie).
"""

from __future__ import annotations

import torch

from k3.cache import StateSnapshot
from k3.config import ModelConfig
from k3.ops.mla_decode import PagedLatents, gather_latents, gather_pages

SCRATCH = 0  # slot and page 0 absorb the writes of padded rows


class CachePool:
    """num_slots KDA slots and num_pages MLA pages (both beyond the scratch one), on `device`."""

    def __init__(self, config: ModelConfig, num_slots: int, num_pages: int, page_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if num_slots < 1 or num_pages < 1 or page_size < 1:
            raise ValueError(f"the cache pool needs at least one slot, one page and a page size >= 1; got "
                             f"{num_slots} slots, {num_pages} pages of {page_size}")
        self.config, self.page_size, self.device, self.dtype = config, page_size, torch.device(device), dtype
        self.kda_layers = [i for i, t in enumerate(config.layer_types) if t != "mla"]
        self.mla_layers = [i for i, t in enumerate(config.layer_types) if t == "mla"]
        self.kda_index = {layer: n for n, layer in enumerate(self.kda_layers)}
        self.mla_index = {layer: n for n, layer in enumerate(self.mla_layers)}
        heads, dim, width = config.kda_num_heads, config.kda_head_dim, config.kda_num_heads * config.kda_head_dim
        n_kda, n_mla = len(self.kda_layers), len(self.mla_layers)
        self.num_slots, self.num_pages = num_slots, num_pages
        # [layers, slots, ...]: slot s of every layer in one index.
        self.kda_state = torch.zeros(n_kda, num_slots + 1, heads, dim, dim, dtype=torch.float32, device=device)
        # The q/k/v conv tails side by side, [layers, slots, W-1, 3C]: one gather and one scatter per layer and
        # step, in the layout of the layer's joined q/k/v conv (see StaticKDASlot).
        self.kda_tails = torch.zeros(n_kda, num_slots + 1, config.kda_conv_kernel - 1, 3 * width, dtype=dtype,
                                     device=device)
        self.latent = torch.zeros(n_mla, num_pages + 1, page_size, config.kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(n_mla, num_pages + 1, page_size, config.qk_rope_head_dim, dtype=dtype,
                                  device=device)
        self._free_slots = list(range(num_slots, 0, -1))  # pop() hands out low numbers first
        self._free_pages = list(range(num_pages, 0, -1))
        self.page_refs = [0] * (num_pages + 1)

    # --- slots --------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free KDA slot (the scheduler admits only what fits)")
        slot = self._free_slots.pop()
        self.kda_state[:, slot].zero_()
        self.kda_tails[:, slot].zero_()
        return slot

    def free_slot(self, slot: int) -> None:
        if slot == SCRATCH or slot in self._free_slots:
            raise RuntimeError(f"KDA slot {slot} freed twice or never handed out")
        self._free_slots.append(slot)

    def copy_slot(self, source: int, target: int) -> None:
        self.kda_state[:, target].copy_(self.kda_state[:, source])
        self.kda_tails[:, target].copy_(self.kda_tails[:, source])

    # --- pages --------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def allocate_pages(self, count: int) -> list[int]:
        if count > len(self._free_pages):
            raise RuntimeError(f"asked for {count} MLA pages, {len(self._free_pages)} free")
        pages = [self._free_pages.pop() for _ in range(count)]
        for page in pages:
            self.page_refs[page] = 1
        return pages

    def share_page(self, page: int) -> None:
        self.page_refs[page] += 1

    def release_page(self, page: int) -> bool:
        """Drop one reference; True when the page is now unreferenced (the caller decides whether it goes back
        to the free list or stays cached for prefix reuse)."""
        if self.page_refs[page] <= 0:
            raise RuntimeError(f"MLA page {page} released more often than it was taken")
        self.page_refs[page] -= 1
        return self.page_refs[page] == 0

    def return_page(self, page: int) -> None:
        if self.page_refs[page] != 0 or page == SCRATCH:
            raise RuntimeError(f"MLA page {page} returned while still referenced")
        self._free_pages.append(page)

    def take_page(self, page: int) -> None:
        """Reference an unreferenced cached page again (a prefix-cache hit)."""
        self.page_refs[page] += 1

    def copy_page(self, source: int, target: int) -> None:
        self.latent[:, target].copy_(self.latent[:, source])
        self.k_rope[:, target].copy_(self.k_rope[:, source])

    # --- accounting ---------------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes of one KDA slot (all KDA layers): constant in the context length."""
        per_state = self.kda_state[:, 0].numel() * self.kda_state.element_size()
        return per_state + self.kda_tails[:, 0].numel() * self.kda_tails.element_size()

    def page_bytes(self) -> int:
        """Bytes of one MLA page (all MLA layers), i.e. page_size tokens of latent cache."""
        return (self.latent[:, 0].numel() * self.latent.element_size()
                + self.k_rope[:, 0].numel() * self.k_rope.element_size())

    def bytes_per_request(self, context: int) -> dict[str, int]:
        pages = -(-context // self.page_size)
        return {"kda": self.slot_bytes(), "mla": pages * self.page_bytes(),
                "total": self.slot_bytes() + pages * self.page_bytes()}


class KDAView:
    """Layer adapter: the rows' slots gathered on read, scattered back on update. Decode advances the states
    where they lie instead (`state_in_place`), which reads and writes each state once where a gather, a new
    state and a scatter move it six times."""

    in_place = True

    def __init__(self, pool: CachePool, layer: int, slots: torch.Tensor,
                 valid_lengths: torch.Tensor | None = None, snapshot: StateSnapshot | None = None,
                 snapshot_slots: torch.Tensor | None = None) -> None:
        self.pool, self.n, self.slots = pool, pool.kda_index[layer], slots
        self.valid_lengths = valid_lengths  # [B]: a padded prefill's real tokens per row (None: all)
        self.snapshot, self.snapshot_slots = snapshot, snapshot_slots  # [B]: where to save it (scratch: nowhere)

    @property
    def state(self) -> torch.Tensor:  # [B, H, dk, dv] fp32
        return self.pool.kda_state[self.n].index_select(0, self.slots)

    @property
    def conv_window(self) -> torch.Tensor:  # [B, W-1, 3C]: the q, k and v tails side by side
        return self.pool.kda_tails[self.n].index_select(0, self.slots)

    @property
    def conv_tails(self) -> tuple[torch.Tensor, ...]:  # 3 x [B, W-1, C]
        return tuple(self.conv_window.chunk(3, dim=-1))

    def state_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's state pool [num_slots + 1, H, dk, dv] fp32, the rows' slots [B]) for
        k3.ops.kda.fused_recurrent_kda_inplace; padded rows name the scratch slot."""
        return self.pool.kda_state[self.n], self.slots

    def conv_window_in_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's window pool [num_slots + 1, W-1, 3C], the rows' slots [B]) for
        k3.ops.conv_step_triton.short_conv_step_inplace: the windows slide where they lie, no gather nor scatter."""
        return self.pool.kda_tails[self.n], self.slots

    def update(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        self.pool.kda_state[self.n].index_copy_(0, self.slots, state.to(torch.float32))
        self.update_conv_tails(tails)

    def update_conv_tails(self, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """tails: the joined window [B, W-1, 3C] or the three tails [B, W-1, C]; one scatter either way."""
        window = tails if isinstance(tails, torch.Tensor) else torch.cat(tails, dim=-1)
        self.pool.kda_tails[self.n].index_copy_(0, self.slots, window.to(self.pool.dtype))

    def save_snapshot(self, state: torch.Tensor, tails: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """The rows' states and tails at snapshot.at into their snapshot slots (a prefix-cache entry's)."""
        window = tails if isinstance(tails, torch.Tensor) else torch.cat(tails, dim=-1)
        self.pool.kda_state[self.n].index_copy_(0, self.snapshot_slots, state.to(torch.float32))
        self.pool.kda_tails[self.n].index_copy_(0, self.snapshot_slots, window.to(self.pool.dtype))


class MLAView:
    """Layer adapter over paged latents. Rows write `T` new tokens at their own positions; attention reads
    the rows' pages gathered to [B, S, R] (S = pages in the table * page_size).

    Decode (`mask_rows` True): every row may sit at a different position, so `visible_mask` [B, 1, T, S] tells
    attention which gathered slots are filled. Prefill (one row, `mask_rows` False): the gather is cut to the
    row's length and `length` reports the cached part, so the layer builds its usual causal mask."""

    def __init__(self, pool: CachePool, layer: int, page_table: torch.Tensor, positions: torch.Tensor,
                 mask_rows: bool, past: int = 0) -> None:
        self.pool, self.n = pool, pool.mla_index[layer]
        self.page_table, self.positions = page_table, positions  # [B, P] int64, [B] int64 (first new position)
        self.mask_rows, self.past = mask_rows, past
        self.visible_mask: torch.Tensor | None = None
        self.visible_limits = None  # the paged decode kernel reads `positions` instead

    @property
    def length(self) -> int:
        return self.past

    @property
    def pages_in_place(self) -> bool:
        """Decode views hand attention the pool itself (append_in_place); prefill views gather (append)."""
        return self.mask_rows

    def _write(self, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write the rows' T new tokens at their positions."""
        length = latent.shape[1]
        size = self.pool.page_size
        position_BT = self.positions[:, None] + torch.arange(length, device=latent.device)  # [B, T]
        page_BT = self.page_table.gather(1, position_BT // size)
        flat_BT = page_BT * size + position_BT % size  # index into [pages * page_size]
        latent_pool = self.pool.latent[self.n].view(-1, latent.shape[-1])
        rope_pool = self.pool.k_rope[self.n].view(-1, k_rope.shape[-1])
        latent_pool.index_copy_(0, flat_BT.reshape(-1), latent.reshape(-1, latent.shape[-1]).to(self.pool.dtype))
        rope_pool.index_copy_(0, flat_BT.reshape(-1), k_rope.reshape(-1, k_rope.shape[-1]).to(self.pool.dtype))

    def pages(self) -> PagedLatents:
        return PagedLatents(self.pool.latent[self.n], self.pool.k_rope[self.n], self.page_table, self.positions)

    def append_in_place(self, latent: torch.Tensor, k_rope: torch.Tensor) -> PagedLatents:
        """Write the new tokens; attention then reads the pages where they lie (k3.ops.mla_decode)."""
        self._write(latent, k_rope)
        return self.pages()

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, T, R], k_rope [B, T, rope] -> the rows' whole context [B, S, R], [B, S, rope] gathered."""
        self._write(latent, k_rope)
        if not self.mask_rows:
            # Prefill: only the pages holding the row's tokens so far, and no [T, S] mask (the layer's causal
            # SDPA call needs none; at 1M context a 48K-token chunk's mask alone would be 48 GiB).
            return gather_latents(self.pages(), self.past + latent.shape[1])
        gathered_latent, gathered_rope, mask = gather_pages(self.pages(), latent.shape[1])
        self.visible_mask = mask  # [B, 1, T, S]
        return gathered_latent, gathered_rope


class BatchCache:
    """What `model.model(ids, cache)` indexes: one adapter per layer for the rows of this forward.

    slots [B] int64 (KDA slot per row), page_table [B, P] int64, positions [B] int64 (where the rows' new
    tokens go). `past` is the rows' common cached length for a prefill view; valid_lengths [B] the real tokens of
    each row of a right-padded prefill (None: every row is real to the end); snapshot / snapshot_slots [B]: KDA
    states to save inside the forward and the slots they go to (k3.cache.StateSnapshot)."""

    def __init__(self, pool: CachePool, slots: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
                 mask_rows: bool, past: int = 0, valid_lengths: torch.Tensor | None = None,
                 snapshot: StateSnapshot | None = None, snapshot_slots: torch.Tensor | None = None) -> None:
        self.batch_size = int(slots.shape[0])
        self.layers = [MLAView(pool, i, page_table, positions, mask_rows, past) if t == "mla"
                       else KDAView(pool, i, slots, valid_lengths, snapshot, snapshot_slots)
                       for i, t in enumerate(pool.config.layer_types)]

    def __getitem__(self, index: int):
        return self.layers[index]
