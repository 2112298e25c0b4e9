"""Prefix caching that is exact for a hybrid KDA + MLA model.

An MLA page depends only on the tokens up to its end, so full prompt pages can be shared by any request whose
prompt starts with the same tokens. A KDA state cannot be rewound: a prefix is reusable only where a state
was saved at exactly that position. So an entry is (a page boundary b, the pages covering [0, b), a copy of
every KDA layer's state and conv tails at b, in a slot of the pool of its own).

Entries are made at two kinds of boundaries, both page-aligned:
- the last page boundary before a prompt's end (a multi-turn episode's next turn, or the next request with
  this prompt, starts there);
- where a new prompt leaves the pages of an earlier one (a shared system prompt): the first request that
  diverges there saves a state, and later ones reuse it.

Pages are keyed by a chained hash of their tokens (page k's key covers tokens [0, (k+1) * page_size)). Each
entry holds a reference on its pages and its slot; when the engine needs room, the least recently used entry that
no lookup ever reused goes first while reused ones fill at most half the cache, else the least recently used
reused one (shared prefixes outlive one-off prompts, as a radix tree keeps its inner nodes while it evicts leaves).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from k3.infer.cache_pool import CachePool


def page_keys(tokens: list[int], page_size: int, limit: int | None = None) -> list[int]:
    """Chained hashes of the full pages of tokens[:limit]: keys[k] identifies tokens[: (k+1) * page_size]."""
    end = len(tokens) if limit is None else min(limit, len(tokens))
    keys, key = [], 0
    for start in range(0, end - page_size + 1, page_size):
        key = hash((key, tuple(tokens[start: start + page_size])))
        keys.append(key)
    return keys


@dataclass
class PrefixEntry:
    boundary: int  # tokens covered
    pages: list[int]  # pages covering [0, boundary)
    slot: int  # KDA state at `boundary`
    hits: int = 0  # lookups that reused it


@dataclass
class PrefixHit:
    boundary: int
    pages: list[int]
    slot: int


class PrefixCache:
    def __init__(self, pool: CachePool, max_entries: int) -> None:
        self.pool, self.max_entries = pool, max_entries
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # key of the boundary's last page -> entry
        self.page_by_key: dict[int, int] = {}
        self.key_refs: dict[int, int] = {}  # how many entries hold the page behind a key
        self.keys_of: dict[int, list[int]] = {}  # entry key -> the page keys it covers
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, tokens: list[int]) -> tuple[PrefixHit | None, int]:
        """The longest saved prefix of `tokens` that leaves at least one token to prefill, and the longest run
        of cached pages (a boundary where saving a new state would let later prompts share more)."""
        size = self.pool.page_size
        keys = page_keys(tokens, size, limit=len(tokens) - 1)
        matched = 0
        while matched < len(keys) and keys[matched] in self.page_by_key:
            matched += 1
        for count in range(matched, 0, -1):
            entry = self.entries.get(keys[count - 1])
            if entry is not None:
                self.entries.move_to_end(keys[count - 1])
                entry.hits += 1
                return PrefixHit(entry.boundary, list(entry.pages), entry.slot), matched * size
        return None, matched * size

    def holds(self, tokens: list[int], boundary: int) -> bool:
        """Whether an entry already saves tokens[:boundary]."""
        size = self.pool.page_size
        return boundary > 0 and boundary % size == 0 and page_keys(tokens, size, limit=boundary)[-1] in self.entries

    def reserve_slot(self) -> int | None:
        """A slot for a new entry's state, evicting to make room; None when there is none to spare. It is the
        caller's until `adopt` takes it (or it is freed)."""
        if len(self.entries) >= self.max_entries and not self.evict_one():
            return None
        if self.pool.free_slots == 0 and not self.evict_one():
            return None
        return self.pool.allocate_slot()

    def insert(self, tokens: list[int], boundary: int, pages: list[int], source_slot: int,
               shared: bool = False) -> bool:
        """Save the KDA state of `source_slot` (a request at exactly `boundary` tokens) with its first pages.
        shared: the boundary is where a prompt leaves an earlier one's pages (two prompts share this prefix), so
        the entry counts as reused from the start (evict_one). Returns False when there is no slot to spare."""
        if boundary <= 0 or boundary % self.pool.page_size:
            return False
        keys = page_keys(tokens, self.pool.page_size, limit=boundary)
        if keys[-1] in self.entries:
            self.entries.move_to_end(keys[-1])
            return True
        slot = self.reserve_slot()
        if slot is None:
            return False
        self.pool.copy_slot(source_slot, slot)
        self._add(keys, boundary, pages, slot, shared)
        return True

    def adopt(self, tokens: list[int], boundary: int, pages: list[int], slot: int, shared: bool = False) -> bool:
        """Make an entry of `slot` (from reserve_slot, holding the KDA state at exactly `boundary` tokens: a
        forward saved it there) with the first pages; the slot is the entry's now, or freed if an entry for these
        tokens exists already. shared: as for insert."""
        size = self.pool.page_size
        keys = page_keys(tokens, size, limit=boundary) if boundary > 0 and boundary % size == 0 else []
        if not keys or keys[-1] in self.entries:
            self.pool.free_slot(slot)
            return False
        self._add(keys, boundary, pages, slot, shared)
        return True

    def _add(self, keys: list[int], boundary: int, pages: list[int], slot: int, shared: bool) -> None:
        """The entry for the pages behind `keys` (page_keys up to boundary) and the state in `slot`."""
        own = pages[: boundary // self.pool.page_size]
        for key, page in zip(keys, own):
            known = self.page_by_key.get(key)
            if known is not None and known != page:
                # The same tokens already live in another page: keep the known one (its content is equal).
                page = known
            self.page_by_key[key] = page
            self.key_refs[key] = self.key_refs.get(key, 0) + 1
            self.pool.share_page(page)
        held = [self.page_by_key[k] for k in keys]
        self.entries[keys[-1]] = PrefixEntry(boundary, held, slot, hits=int(shared))
        self.keys_of[keys[-1]] = keys

    def evict_one(self) -> bool:
        """Drop the least recently used entry that was never reused while reused ones fill at most half the cache,
        else the least recently used reused one (its slot and its page references). A prefix that served other
        prompts (a system prompt, an episode's earlier turn) outlives one-off prompts' entries: with one entry per
        prompt, plain LRU let a burst of new prompts evict the system prompt every round (debug model, CPU, 32
        chat-like prompts a round, 16 entries: 16 hits of 32). The half bound keeps stale reused entries from holding the
        whole cache, so a new conversation's first turn still lives until its second."""
        if not self.entries:
            return False
        reused = sum(1 for entry in self.entries.values() if entry.hits)
        take_reused = reused > self.max_entries // 2
        last_key = next((key for key, entry in self.entries.items() if bool(entry.hits) == take_reused),
                        next(iter(self.entries)))
        entry = self.entries.pop(last_key)
        keys = self.keys_of.pop(last_key)
        self.pool.free_slot(entry.slot)
        for key, page in zip(keys, entry.pages):
            self.key_refs[key] -= 1
            if self.key_refs[key] == 0:
                del self.key_refs[key]
                del self.page_by_key[key]
            if self.pool.release_page(page):
                self.pool.return_page(page)
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass
