"""The runner only runs: given a step's decodes and prefill chunks, it forwards the model over the pool and
returns next-token logits. It decides nothing.

- A decode batch is one forward of [B, 1]: each row reads its KDA slot and its MLA pages (gathered to the
  batch's longest page table) and writes its new token back.
- Prefill chunks that cover the same positions (say, the first 512 tokens of several new prompts) run as one
  forward of [B, T], each row continuing from its own cached state; only the last position goes through the
  LM head.
- On CUDA, decode batches run as CUDA graphs captured once per batch size in `graph_batch_sizes` (a batch is
  padded to the next captured size; padded rows use the pool's scratch slot and page). Their page tables
  are padded to the pool's largest table, so one graph serves every context length. The eager path is the
  PyTorch twin; tests hold the two equal.
- With compile_decode (K3_COMPILE_DECODE=1; default off) decode forwards, captured graphs included, run
  through torch.compile as one graph (compiled_decode_logits): inductor fuses the elementwise kernels between
  the GEMMs and fla kernels. Batch rows, page-table width and pool sizes are marked dynamic, so an engine
  compiles twice (a batch of one row, and any larger batch) during its first decodes or graph captures.
"""

from __future__ import annotations

import functools

import torch

from k3 import kernels
from k3.cache import StateSnapshot
from k3.infer.cache_pool import SCRATCH, BatchCache, CachePool
from k3.infer.scheduler import Sequence, pages_for


def compile_decode_from_env() -> bool:
    """K3_COMPILE_DECODE=1 turns the compiled decode step on where the engine captures its graphs (default 0)."""
    return kernels.enabled("compile_decode")


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, cache: BatchCache) -> torch.Tensor:
    """A decode forward over the pool: ids [B, 1] -> next-token logits [B, V]."""
    return model.lm_head(model.model(ids, cache)[:, -1])


# Batch size and page-table width marked dynamic before the first compile. Left to dynamo's automatic dynamic,
# each new batch size or table width compiled once more until it went symbolic: four compiles of `small` (batch
# 1 and 2+, width 1 and 2+; about a minute each on one H200) before an engine served its first batches, more
# for a second engine of another context length. Sizes 0 and 1 always get their own graph, so tables are at
# least MIN_TABLE_PAGES wide: a batch of one row and a batch of several are the only two compiles.
MIN_TABLE_PAGES = 2


@functools.lru_cache(maxsize=1)
def compiled_decode_logits():
    """decode_logits through torch.compile, one graph (fullgraph); the runner marks batch shapes and pool sizes
    dynamic (mark_dims_dynamic)."""
    return torch.compile(decode_logits, fullgraph=True)


def mark_dims_dynamic(*tensor_dims: tuple[torch.Tensor, int]) -> None:
    """Tell dynamo that these (tensor, dim) sizes vary between calls. A hint: a size of 0 or 1, or one it must
    specialise, stays static."""
    for tensor, dim in tensor_dims:
        if tensor.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def mark_decode_shapes_dynamic(ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                               table: torch.Tensor) -> None:
    """What varies between decode batches: the rows and the page table's width."""
    mark_dims_dynamic((ids, 0), (slots, 0), (positions, 0), (table, 0), (table, 1))


class ModelRunner:
    def __init__(self, model, pool: CachePool, max_pages_per_seq: int, use_cuda_graphs: bool | None = None,
                 graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128),
                 compile_decode: bool | None = None) -> None:
        self.model, self.pool = model, pool
        self.device = pool.device
        self.max_pages_per_seq = max_pages_per_seq
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        if use_cuda_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.use_cuda_graphs = use_cuda_graphs
        self.graph_batch_sizes = tuple(sorted(graph_batch_sizes))
        self.graphs: dict[int, _DecodeGraph] = {}
        self._graph_pool = None
        self.compile_decode = compile_decode_from_env() if compile_decode is None else compile_decode
        if self.compile_decode:
            # What varies between engines: the pool's slot and page counts (marked once, the pool lives on).
            mark_dims_dynamic((pool.kda_state, 1), (pool.kda_tails, 1), (pool.latent, 1), (pool.k_rope, 1))
        self._decode_fn = compiled_decode_logits() if self.compile_decode else decode_logits

    # --- eager paths --------------------------------------------------------------------------------
    def _forward_last(self, ids: torch.Tensor, cache: BatchCache, embeds: torch.Tensor | None = None,
                      last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits after each row's last token: position -1, or last [B] (a padded batch's own ends)."""
        hidden = self.model.model(ids, cache, inputs_embeds=embeds)
        if last is None:
            return self.model.lm_head(hidden[:, -1])
        return self.model.lm_head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence], start: int | list[int], end: int | list[int],
                snapshots: list[tuple[int, int] | None] | None = None) -> torch.Tensor:
        """Write tokens [start, end) of each sequence into its cache in one forward -> logits [B, V] after each
        row's last token. `start` and `end` may differ by row (lists). Shorter rows are padded on the right to the
        longest, and the padding leaves every cache as the row's own tokens left it (KDA: no state or tail change,
        k3.layers.kda; MLA: written past the row's end, where its own later tokens overwrite it before anything
        reads there). Rows from one position attend causally after it; rows from different positions attend as
        decode does, each from its own position under a mask (short chunks only: scheduler.prefill_forwards).
        Every row's pages must reach its start plus the longest chunk. snapshots: per row None, or (a position
        strictly inside its chunk, a KDA slot): its KDA states and tails there are saved into that slot (a
        prefix-cache entry's), so the forward runs through the boundary instead of stopping at it."""
        starts = [start] * len(seqs) if isinstance(start, int) else list(start)
        ends = [end] * len(seqs) if isinstance(end, int) else list(end)
        lengths_B = [e - s for s, e in zip(starts, ends)]
        width = max(lengths_B)
        padded = any(n != width for n in lengths_B)
        ragged = any(s != starts[0] for s in starts)
        ids = torch.tensor([seq.tokens[s:e] + [0] * (width - (e - s)) for seq, s, e in zip(seqs, starts, ends)],
                           device=self.device)
        embeds = None
        if any(s.prompt_embeds is not None for s in seqs):
            if padded or ragged:
                raise ValueError("rows with image embeddings are prefilled at one common (start, end)")
            # Rows with image embeddings take them; the others embed their ids as the model would.
            plain = self.model.model.embed_tokens(ids)
            embeds = torch.stack([s.prompt_embeds[starts[0]:ends[0]].to(plain.dtype) if s.prompt_embeds is not None
                                  else plain[row] for row, s in enumerate(seqs)])
        pages = max(pages_for(s + width, self.pool.page_size) for s in starts)
        # Rows that need fewer pages than the widest read the scratch page past their own (never visible to them).
        table = torch.tensor([(seq.pages[:pages] + [SCRATCH] * pages)[:pages] for seq in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        positions = torch.tensor(starts, device=self.device)
        lengths = torch.tensor(lengths_B, device=self.device) if padded else None
        snapshot = snapshot_slots = None
        if snapshots is not None and any(snapshots):
            at = [n if snap is None else snap[0] - s for snap, s, n in zip(snapshots, starts, lengths_B)]
            rest = max(n - a for n, a in zip(lengths_B, at))
            snapshot = StateSnapshot(torch.tensor(at, device=self.device), rest)
            snapshot_slots = torch.tensor([SCRATCH if snap is None else snap[1] for snap in snapshots],
                                          device=self.device)
        cache = BatchCache(self.pool, slots, table, positions, mask_rows=ragged, past=starts[0],
                           valid_lengths=lengths, snapshot=snapshot, snapshot_slots=snapshot_slots)
        return self._forward_last(ids, cache, embeds, None if lengths is None else lengths - 1)

    def _decode_inputs(self, seqs: list[Sequence], rows: int, table_pages: int, pin: bool = False):
        """Host tensors (ids [rows, 1], slots, positions [rows], page table [rows, table_pages], int64) for a
        decode batch padded to `rows` rows (padding: scratch slot and page). pin: put them in pinned memory, so
        that a non-blocking copy to the device is asynchronous."""
        size = self.pool.page_size
        n = len(seqs)
        # The four inputs are slices of one flat buffer filled through numpy: torch.tensor over nested lists
        # spent about 1 ms a step on a 64-row batch with tables padded to 260 pages, this about 0.08 ms.
        # The device is named so that a surrounding torch.device context cannot move the buffer off the host.
        flat = torch.empty(rows * (3 + table_pages), dtype=torch.long, device="cpu", pin_memory=pin)
        host = flat.numpy()
        cached = [s.num_cached for s in seqs]
        # A row whose token a step in flight sampled has none here yet: the device copy fills it (decode's tokens).
        host[:n] = [s.tokens[c] if c < len(s.tokens) else 0 for s, c in zip(seqs, cached)]
        host[n:rows] = 0
        host[rows:rows + n] = [s.slot for s in seqs]
        host[rows + n:2 * rows] = SCRATCH
        host[2 * rows:2 * rows + n] = cached
        host[2 * rows + n:3 * rows] = 0
        table = host[3 * rows:].reshape(rows, table_pages)
        table.fill(SCRATCH)
        for row, (s, c) in enumerate(zip(seqs, cached)):
            used = s.pages[: pages_for(c + 1, size)]
            table[row, : len(used)] = used
        return (flat[:rows].view(rows, 1), flat[rows:2 * rows], flat[2 * rows:3 * rows],
                flat[3 * rows:].view(rows, table_pages))

    @torch.no_grad()
    def decode(self, seqs: list[Sequence],
               tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One token for each sequence (its last sampled one, at position num_cached) -> logits [B, V].
        tokens: (rows [k], ids [k]) on the device: those rows' tokens, sampled by a step whose results the host
        has not read yet (the engine's overlap_steps), instead of seq.tokens."""
        if self.use_cuda_graphs and len(seqs) <= self.graph_batch_sizes[-1]:
            return self._decode_graph(seqs, tokens)
        # Page tables rounded up to a power of two pages: fewer distinct shapes, same result (masked slots).
        longest = max(pages_for(s.num_cached + 1, self.pool.page_size) for s in seqs)
        table_pages = min(max(1 << (longest - 1).bit_length(), MIN_TABLE_PAGES), self.max_pages_per_seq)
        pin = self.device.type == "cuda"  # pinned: copies that do not wait for the step in flight
        ids, slots, positions, table = (t.to(self.device, non_blocking=pin)
                                        for t in self._decode_inputs(seqs, len(seqs), table_pages, pin=pin))
        if tokens is not None:
            ids[tokens[0], 0] = tokens[1]
        if self.compile_decode:
            mark_decode_shapes_dynamic(ids, slots, positions, table)
        cache = BatchCache(self.pool, slots, table, positions, mask_rows=True)
        return self._decode_fn(self.model, ids, cache)

    # --- CUDA graphs --------------------------------------------------------------------------------
    def _decode_graph(self, seqs: list[Sequence], tokens=None) -> torch.Tensor:
        rows = next(b for b in self.graph_batch_sizes if b >= len(seqs))
        # Pinned inputs: the graph's four copies to the device then return at once instead of each staging its
        # bytes through the driver (the caching host allocator keeps a block until the copies that read it ran).
        inputs = self._decode_inputs(seqs, rows, self.max_pages_per_seq, pin=True)
        return self._graph(rows).run(*inputs, tokens=tokens)[: len(seqs)]

    def _graph(self, rows: int) -> "_DecodeGraph":
        """The decode graph for `rows` rows, captured on first use (all graphs share one memory pool)."""
        if rows not in self.graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            self.graphs[rows] = _DecodeGraph(self, rows, self._graph_pool)
        return self.graphs[rows]

    def capture(self, batch_sizes: tuple[int, ...] | None = None) -> None:
        """Capture the decode graphs now (otherwise each is captured on first use)."""
        if self.use_cuda_graphs:
            for rows in batch_sizes or self.graph_batch_sizes:
                self._graph(rows)


class _DecodeGraph:
    """A decode step for `rows` rows captured as a CUDA graph over static input buffers. Warm-up and capture
    run on the scratch slot and page only, so capturing never touches a live request's cache."""

    def __init__(self, runner: ModelRunner, rows: int, pool_handle, warmup: int = 2) -> None:
        device = runner.device
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), SCRATCH, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.table = torch.full((rows, runner.max_pages_per_seq), SCRATCH, dtype=torch.long, device=device)
        if runner.compile_decode:
            mark_decode_shapes_dynamic(self.ids, self.slots, self.positions, self.table)
        cache = BatchCache(runner.pool, self.slots, self.table, self.positions, mask_rows=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                runner._decode_fn(runner.model, self.ids, cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool_handle), torch.no_grad():
            self.logits = runner._decode_fn(runner.model, self.ids, cache)

    def run(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
            tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        self.ids.copy_(ids, non_blocking=True)
        if tokens is not None:  # rows whose token is still on the device (ModelRunner.decode)
            self.ids[tokens[0], 0] = tokens[1]
        self.slots.copy_(slots, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        self.table.copy_(table, non_blocking=True)
        self.graph.replay()
        return self.logits.clone()
