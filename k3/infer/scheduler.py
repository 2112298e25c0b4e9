"""The scheduler decides; it owns no tensors. Each engine step it picks:

1. every running sequence that has its whole prompt in the cache: one decode token each (decodes first);
2. then prefill chunks of the sequences still reading their prompt, oldest first, within the step's token
   budget (the first chunk always runs, so a prefill cannot starve);
3. then admits waiting requests, first come first served, while a KDA slot and enough MLA pages are free.

Prefill chunks end at multiples of `prefill_chunk` from the start of the prompt, never where the budget happens
to run out: the same prompt is then cut the same way whatever else is running, so its numbers (and its greedy
output) do not depend on the batch. A prefix-cache boundary inside a chunk does not cut it: the forward saves
the KDA state there on its way (k3.cache.StateSnapshot), one boundary per chunk (a second one is a cut). The chunks
from one position then run as one forward, the shorter right-padded (prefill_forwards): chats' prompts rarely
share a length, and a short forward on a GPU costs about the same for one row as for many.

Memory is reserved at admission for the whole request (prompt + max_new_tokens, capped by the context), so a
running request can never run out of pages and nothing is ever preempted. A request with n samples reserves
n slots and the pages of its n continuations; its prompt is prefilled once and the cache forked.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3.infer.cache_pool import CachePool
from k3.infer.prefix_cache import PrefixCache
from k3.infer.sampling import SamplingParams

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"
# Gathering new prompts (Scheduler gather_s) stops once none has arrived for this long.
GATHER_QUIET_S = 0.002


@dataclass
class Sequence:
    """One sample of a request: its tokens, where it stands in the cache, and its share of the pool."""

    request_id: str
    index: int  # sample index within the request
    params: SamplingParams
    tokens: list[int]  # prompt + generated
    prompt_len: int
    num_cached: int = 0  # tokens written into the cache
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    shared_pages: int = 0  # leading pages shared with others (prefix hit or fork)
    cuts: list[int] = field(default_factory=list)  # prefill chunk ends
    register_at: list[int] = field(default_factory=list)  # prefix-cache boundaries to save
    shared_at: int = 0  # of those, where it leaves the pages of an earlier prompt (a shared prefix), or 0
    status: str = WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_counts: torch.Tensor | None = None  # [V] for penalties
    prompt_counts: torch.Tensor | None = None
    stop_text: object | None = None  # its text so far (k3.infer.detokenize.TextAssembler) when params.stop is set
    first_token_time: float | None = None
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, D] input embeddings (images) instead of ids
    routing: list[list[torch.Tensor]] | None = None  # per MoE layer, the [T, K] expert ids of each forward
    stop_ids: frozenset[int] = frozenset()
    matcher: object | None = None  # its grammar's state (k3.infer.structured.Matcher) when params.grammar is set

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    prompt_embeds: torch.Tensor | None = None
    stop_ids: frozenset[int] = frozenset()  # the params' stop tokens and the tokenizer's EOS
    sequences: list[Sequence] = field(default_factory=list)
    # Resources reserved at admission for the samples that the fork will create.
    reserved_slots: list[int] = field(default_factory=list)
    reserved_pages: list[list[int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.status == FINISHED for s in self.sequences)


@dataclass
class StepPlan:
    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int, int]]  # (sequence, start, end)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


# Short chunks (next turns' tails after their prefix-cache hits) share a forward whatever
# their positions: each row attends from its own position under a mask (the decode path's latent attention),
# whose [T, S] scores are only affordable for few queries over a bounded context.
RAGGED_MAX_TOKENS = 32
RAGGED_MAX_CONTEXT = 8192
# Padding allowed among short chunks: a few dozen tokens a row cost next to nothing beside a forward's launches.
RAGGED_MAX_PADDING = 0.75


@dataclass
class PrefillForward:
    """Prefill chunks that run as one forward: row i writes tokens [starts[i], ends[i]), padded on the right to
    the longest chunk. Rows from different positions (a ragged forward) only for short chunks."""

    seqs: list[Sequence]
    starts: list[int]
    ends: list[int]

    @property
    def width(self) -> int:
        return max(end - start for start, end in zip(self.starts, self.ends))


def prefill_forwards(prefills: list[tuple[Sequence, int, int]], page_size: int, max_tokens: int,
                     max_padding: float = 0.25) -> list[PrefillForward]:
    """Group a step's prefill chunks into forwards. A forward costs much the same from one row to many while it
    is short (launch-bound on a GPU), and chats' prompts rarely share a length, so chunks from the same position
    share a forward, right-padded to the longest, as long as the padding stays at most `max_padding` of the
    forward's tokens, the forward at most `max_tokens` (a longer chunk runs alone), and every row's reserved pages
    reach its start plus the forward's width (padding is written there). Short chunks (at most RAGGED_MAX_TOKENS,
    ending within RAGGED_MAX_CONTEXT) that would run in several forwards share one from any positions, padded up to
    RAGGED_MAX_PADDING (max_padding 0: none anywhere). Rows with image embeddings share only an exact (start, end)."""
    images: dict[tuple[int, int], list[tuple[Sequence, int, int]]] = {}
    by_start: dict[int, list[tuple[Sequence, int, int]]] = {}
    for seq, start, end in prefills:
        if seq.prompt_embeds is not None:
            images.setdefault((start, end), []).append((seq, start, end))
        else:
            by_start.setdefault(start, []).append((seq, start, end))
    forwards = [PrefillForward(*(list(column) for column in zip(*rows))) for rows in images.values()]
    grouped = [f for rows in by_start.values() for f in _pack(rows, page_size, max_tokens, max_padding)]
    long, short = [], []
    for forward in grouped:
        is_short = forward.width <= RAGGED_MAX_TOKENS and max(forward.ends) <= RAGGED_MAX_CONTEXT
        (short if is_short else long).append(forward)
    if len(short) > 1:  # several short forwards: their rows again, from any position
        grouped = long + _pack([row for f in short for row in zip(f.seqs, f.starts, f.ends)], page_size,
                               max_tokens, max(max_padding, RAGGED_MAX_PADDING) if max_padding > 0 else 0.0)
    return forwards + grouped


def _pack(rows: list[tuple[Sequence, int, int]], page_size: int, max_tokens: int,
          max_padding: float) -> list[PrefillForward]:
    """Rows into forwards, the longest chunk first (it sets a forward's width), each row joining the open forward
    while the limits of prefill_forwards hold."""
    forwards: list[PrefillForward] = []
    group: PrefillForward | None = None
    for seq, start, end in sorted(rows, key=lambda row: row[1] - row[2]):
        if group is not None:
            width, count = group.ends[0] - group.starts[0], len(group.ends) + 1
            real = sum(group.ends) - sum(group.starts) + end - start
            padded = width * count
            if (padded <= max_tokens and padded - real <= max_padding * padded
                    and len(seq.pages) >= pages_for(start + width, page_size)):
                group.seqs.append(seq)
                group.starts.append(start)
                group.ends.append(end)
                continue
        group = PrefillForward([seq], [start], [end])
        forwards.append(group)
    return forwards


class Scheduler:
    def __init__(self, pool: CachePool, prefix_cache: PrefixCache | None, max_batch: int, max_context: int,
                 prefill_chunk: int, max_step_tokens: int, gather_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """gather_s: the longest a new prompt's first forward waits for prompts arriving with it (0: never); it
        waits only while prompts keep arriving (one did within GATHER_QUIET_S) and the new prompts do not yet
        fill a step. clock: the time of arrivals and of plan() (tests pass their own)."""
        if prefill_chunk % pool.page_size:
            raise ValueError(f"prefill_chunk ({prefill_chunk}) must be a multiple of page_size ({pool.page_size})")
        if gather_s < 0:
            raise ValueError(f"gather_s must be >= 0, got {gather_s}")
        self.pool, self.prefix_cache = pool, prefix_cache
        self.max_batch, self.max_context = max_batch, max_context
        self.prefill_chunk, self.max_step_tokens = prefill_chunk, max_step_tokens
        self.gather_s, self.clock = gather_s, clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.gathering_until: float | None = None  # set by plan() while new prompts wait for more to arrive

    # --- queries ------------------------------------------------------------------------------------
    def running_sequences(self) -> list[Sequence]:
        return [s for r in self.running for s in r.sequences if s.status != FINISHED]

    def budget(self, request: Request) -> int:
        """Tokens the cache must hold for one sample: prompt + new tokens, capped by the context."""
        return min(len(request.prompt) + request.params.max_new_tokens, self.max_context)

    # --- admission ----------------------------------------------------------------------------------
    def admit(self) -> list[Request]:
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            running = sum(r.params.n for r in self.running)
            if running + request.params.n > self.max_batch or not self._try_reserve(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _free_enough(self, slots: int, pages: int) -> bool:
        while self.pool.free_slots < slots or self.pool.free_pages < pages:
            if self.prefix_cache is None or not self.prefix_cache.evict_one():
                return False
        return True

    def _try_reserve(self, request: Request) -> bool:
        size, n, prompt = self.pool.page_size, request.params.n, request.prompt
        total_pages = pages_for(self.budget(request), size)
        # Prompts with image embeddings share no prefix: their placeholder ids do not say what the image was.
        caching = self.prefix_cache is not None and request.prompt_embeds is None
        hit, matched = self.prefix_cache.lookup(prompt) if caching else (None, 0)
        shared = 0 if hit is None else hit.boundary // size
        # Pages each extra sample needs of its own: from the last full prompt page on.
        own_pages_child = total_pages - len(prompt) // size
        need_pages = (total_pages - shared) + (n - 1) * own_pages_child
        if hit is not None:
            # Hold the hit's pages and state before evicting anything to make room.
            for page in hit.pages:
                self.pool.take_page(page)
        if not self._free_enough(n, need_pages):
            if hit is not None:
                for page in hit.pages:
                    if self.pool.release_page(page):
                        self.pool.return_page(page)
            return False
        parent = Sequence(request.request_id, 0, request.params, list(prompt), len(prompt),
                          prompt_embeds=request.prompt_embeds, stop_ids=request.stop_ids)
        parent.slot = self.pool.allocate_slot()
        parent.pages = (list(hit.pages) if hit is not None else []) + self.pool.allocate_pages(total_pages - shared)
        parent.shared_pages = shared
        if hit is not None:
            self.pool.copy_slot(hit.slot, parent.slot)
            parent.num_cached = hit.boundary
            self.prefix_cache.hits += 1
            self.prefix_cache.hit_tokens += hit.boundary
        parent.cuts, parent.register_at = self._cuts(prompt, parent.num_cached, matched, caching)
        parent.shared_at = matched if matched in parent.register_at else 0
        parent.status = PREFILL
        request.sequences = [parent]
        for _ in range(n - 1):
            request.reserved_slots.append(self.pool.allocate_slot())
            request.reserved_pages.append(self.pool.allocate_pages(own_pages_child))
        return True

    def _cuts(self, prompt: list[int], start: int, matched: int, caching: bool) -> tuple[list[int], list[int]]:
        length, size = len(prompt), self.pool.page_size
        register = []
        if caching:
            last_boundary = ((length - 1) // size) * size
            register = sorted({b for b in (matched, last_boundary) if start < b < length})
        # A chunk runs through one boundary inside it (the forward saves the state there: StateSnapshot) and
        # stops at any other: of two boundaries in one chunk, the earlier becomes a cut.
        chunks = set(range(self.prefill_chunk, length, self.prefill_chunk)) | {length}
        cuts = set(chunks)
        for boundary, following in zip(register, register[1:]):
            if following not in chunks and not any(boundary < c < following for c in chunks):
                cuts.add(boundary)
        return sorted(c for c in cuts if c > start), register

    # --- planning -----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival = self.clock()
        self.waiting.append(request)

    def _fresh(self) -> list[tuple[Request, int]]:
        """Running requests whose prompt has not been in any forward yet, with their first chunk's tokens."""
        fresh = []
        for request in self.running:
            seq = request.sequences[0] if request.sequences else None
            if seq is not None and seq.status == PREFILL and seq.cuts and seq.num_cached < seq.cuts[0]:
                fresh.append((request, seq.cuts[0] - seq.num_cached))
        return fresh

    def _gather_deadline(self, fresh: list[tuple[Request, int]], room: int) -> float | None:
        """While new prompts (not yet in any forward) keep arriving, until when their first forwards wait for
        more (None: run them now). Prompts arriving together then share forwards: on a GPU a prefill forward's
        cost is mostly the host's launches, whatever its rows, and each one stalls every decoding row."""
        if not fresh or sum(tokens for _, tokens in fresh) >= room:
            return None
        now = self.clock()
        newest = max(request.arrival for request, _ in fresh)
        oldest = min(request.arrival for request, _ in fresh)
        until = min(newest + min(GATHER_QUIET_S, self.gather_s), oldest + self.gather_s)
        return until if now < until else None

    def plan(self) -> StepPlan:
        self.admit()
        running = self.running_sequences()
        decodes = [s for s in running if s.status == DECODE]
        room = self.max_step_tokens - len(decodes)
        held: set[int] = set()
        self.gathering_until = None
        if self.gather_s > 0:
            fresh = self._fresh()
            self.gathering_until = self._gather_deadline(fresh, room)
            if self.gathering_until is not None:
                held = {id(request.sequences[0]) for request, _ in fresh}
        prefills: list[tuple[Sequence, int, int]] = []
        for seq in running:
            if seq.status != PREFILL or id(seq) in held:
                continue
            end = next(c for c in seq.cuts if c > seq.num_cached)
            tokens = end - seq.num_cached
            if tokens > room and (prefills or decodes):
                break
            prefills.append((seq, seq.num_cached, end))
            room -= tokens
            if room <= 0:
                break
        return StepPlan(decodes, prefills)

    # --- release ------------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Give a finished or aborted sequence's slot and pages back."""
        if seq.slot is not None:
            self.pool.free_slot(seq.slot)
            seq.slot = None
        for page in seq.pages:
            if self.pool.release_page(page):
                self.pool.return_page(page)
        seq.pages = []

    def release_reserved(self, request: Request) -> None:
        for slot in request.reserved_slots:
            self.pool.free_slot(slot)
        for pages in request.reserved_pages:
            for page in pages:
                if self.pool.release_page(page):
                    self.pool.return_page(page)
        request.reserved_slots, request.reserved_pages = [], []

    def fork(self, request: Request) -> list[Sequence]:
        """The parent has its whole prompt in the cache: make the other n-1 samples share its full pages and
        copy its state and its partly filled last page."""
        parent = request.sequences[0]
        size = self.pool.page_size
        full = parent.prompt_len // size
        children = []
        for index, (slot, own) in enumerate(zip(request.reserved_slots, request.reserved_pages), start=1):
            child = Sequence(request.request_id, index, request.params, list(parent.tokens), parent.prompt_len,
                             num_cached=parent.num_cached, slot=slot, status=DECODE, stop_ids=parent.stop_ids,
                             routing=None if parent.routing is None else [list(r) for r in parent.routing])
            self.pool.copy_slot(parent.slot, slot)
            for page in parent.pages[:full]:
                self.pool.share_page(page)
            child.pages = parent.pages[:full] + own
            child.shared_pages = full
            if parent.prompt_len % size:
                self.pool.copy_page(parent.pages[full], own[0])
            children.append(child)
        request.reserved_slots, request.reserved_pages = [], []
        request.sequences.extend(children)
        return children

    def remove_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done
