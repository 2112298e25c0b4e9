"""Token ids -> text as they arrive, for streaming: incomplete UTF-8 characters and text that may turn out to
be the start of a stop string are held back until they are settled.

`IncrementalDecoder` decodes a short window (the previous token plus the new ones) and keeps only what the
new tokens add, so each step costs O(window) and tokenizers whose decoders treat the first token specially
(a leading-space marker) still give the same text as decoding everything at once.
`StopStringMatcher` finds the first stop string in the text and holds back any tail that could begin one.
`TextAssembler` joins the two: push(token) -> new visible text; the text it has released plus what finish()
returns equals decode(all tokens) cut at the first stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not yet a whole UTF-8 character


class IncrementalDecoder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: one token before the first token whose text is not yet released
        self.read = 0  # tokens before this index have had their text released

    def push(self, token: int) -> str:
        """Add a token; return the text it completes ('' while a character is still incomplete)."""
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopStringMatcher:
    """Keeps only the text not yet released (a possible start of a stop string) and the released pieces, so a
    token costs O(its text + the longest stop string), not O(all text so far)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pieces: list[str] = []  # released text, in order
        self.pending = ""  # text not yet released
        self.stopped = False

    @property
    def text(self) -> str:
        """All released text (joined on each read: read it once, at the end)."""
        return "".join(self.pieces)

    def feed(self, delta: str) -> str:
        """Add text; return what is now safe to show. After a stop string is found, `stopped` is True and
        nothing more is returned."""
        if self.stopped:
            return ""
        if not self.stops:
            if delta:
                self.pieces.append(delta)
            return delta
        pending = self.pending + delta
        # A stop string cannot start inside released text: any such start was held back as a possible prefix.
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = pending[:min(hits)], ""
        else:
            safe = len(pending) - self._held_tail(pending)
            out, self.pending = pending[:safe], pending[safe:]
        if out:
            self.pieces.append(out)
        return out

    def _held_tail(self, pending: str) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """At the end of generation the held-back tail is plain text after all."""
        if self.stopped:
            return ""
        out, self.pending = self.pending, ""
        if out:
            self.pieces.append(out)
        return out


class TextAssembler:
    """One generated sequence's visible text."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.matcher = StopStringMatcher(stops)

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared (the text ends just before it)."""
        return self.matcher.stopped

    @property
    def text(self) -> str:
        return self.matcher.text

    def push(self, token: int) -> str:
        return self.matcher.feed(self.decoder.push(token))

    def finish(self) -> str:
        return self.matcher.feed(self.decoder.flush()) + self.matcher.flush()
