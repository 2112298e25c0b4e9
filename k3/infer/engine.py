"""Generation: prefill the prompt into a HybridCache, then decode one token at a time against the cache.

Batches stay exact: prompts are grouped by token length and each group runs as one batch with no padding
(the cache has no notion of padded positions, and padding a KDA state would change it). Finished rows leave
the batch through `HybridCache.select`. MoE routing in eval mode is per token, so batching never changes a row.

`Session` holds one conversation's cache (chat): feed tokens, generate, feed more; nothing is recomputed.
"""

from __future__ import annotations

from typing import Callable

import torch

from k3.cache import HybridCache
from k3.infer.sampling import SamplingParams, sample_next

TokenCallback = Callable[[int, int], None]  # (prompt index, token id)


class Engine:
    """model: K3ForCausalLM (put in eval mode here); tokenizer: the project's tokenizer interface.
    max_context bounds prompt + generated tokens per sequence."""

    def __init__(self, model, tokenizer, max_context: int = 4096) -> None:
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.device = next(model.parameters()).device

    def _check_prompt(self, ids: list[int], index: int) -> None:
        if not ids:
            raise ValueError(f"prompt {index} is empty after tokenization; give at least one token of text")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt {index} has {len(ids)} tokens but the context allows {self.max_context} "
                             f"(prompt plus at least one new token); shorten the prompt or raise --max-context")
        vocab = self.model.config.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise ValueError(f"prompt {index} holds token ids outside [0, {vocab}); the tokenizer does not match "
                             f"the model")

    def stop_ids(self, params: SamplingParams) -> set[int]:
        stops = set(params.stop_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        return stops

    @torch.no_grad()
    def generate_ids(self, prompts: list[list[int]], params: SamplingParams,
                     on_token: TokenCallback | None = None) -> list[list[int]]:
        """prompts: token id lists -> the new tokens of each (stop token included when one ended it)."""
        for i, ids in enumerate(prompts):
            self._check_prompt(ids, i)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        outputs: list[list[int]] = [[] for _ in prompts]
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(prompts):
            groups.setdefault(len(ids), []).append(i)
        for length in sorted(groups):
            members = groups[length]
            batch = torch.tensor([prompts[i] for i in members], device=self.device)
            self._generate_group(batch, members, params, generator, outputs, on_token)
        return outputs

    def _generate_group(self, batch: torch.Tensor, members: list[int], params: SamplingParams,
                        generator: torch.Generator | None, outputs: list[list[int]],
                        on_token: TokenCallback | None) -> None:
        """batch [B, L] prompts of one length; appends each row's new tokens to outputs[members[row]]."""
        budget = min(params.max_new_tokens, self.max_context - batch.shape[1])
        if budget <= 0:
            return
        stops = self.stop_ids(params)
        cache = self.model.new_cache(batch.shape[0])
        logits = self.model(batch, cache=cache).logits[:, -1]  # prefill
        alive = list(members)
        for step in range(budget):
            tokens = sample_next(logits, params, generator)  # [B_alive]
            keep = []
            for row, (index, token) in enumerate(zip(alive, tokens.tolist())):
                outputs[index].append(token)
                if on_token is not None:
                    on_token(index, token)
                if token not in stops:
                    keep.append(row)
            if not keep or step == budget - 1:
                break
            if len(keep) < len(alive):
                keep_index = torch.tensor(keep, device=self.device)
                cache.select(keep_index)
                tokens = tokens[keep_index]
                alive = [alive[r] for r in keep]
            logits = self.model(tokens[:, None], cache=cache).logits[:, -1]  # one cached decode step

    def generate(self, prompts: list[str], params: SamplingParams,
                 on_token: TokenCallback | None = None) -> list[str]:
        """Text in, generated text out (stop tokens removed)."""
        ids = [self.tokenizer.encode(p) for p in prompts]
        stops = self.stop_ids(params)
        out = self.generate_ids(ids, params, on_token)
        return [self.tokenizer.decode([t for t in seq if t not in stops]) for seq in out]


@torch.no_grad()
def greedy_without_cache(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: every step recomputes the full forward over prompt + generated tokens (no cache)."""
    ids = list(prompt)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1]
        ids.append(int(logits.float().argmax()))
    return ids[len(prompt):]


class Session:
    """One growing sequence with its cache (for chat): `feed` appends tokens, `generate` continues it.
    Generated tokens stay in the context; the last one is fed lazily with the next call."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cache: HybridCache = engine.model.new_cache(1)
        self.length = 0
        self._pending: list[int] = []
        self._logits: torch.Tensor | None = None

    @torch.no_grad()
    def feed(self, ids: list[int]) -> None:
        ids = self._pending + list(ids)
        self._pending = []
        if not ids:
            return
        if self.length + len(ids) >= self.engine.max_context:
            raise ValueError(f"the conversation would reach {self.length + len(ids)} tokens but the context "
                             f"allows {self.engine.max_context}; start a new chat or raise --max-context")
        tensor = torch.tensor([ids], device=self.engine.device)
        self._logits = self.engine.model(tensor, cache=self.cache).logits[:, -1]
        self.length += len(ids)

    @torch.no_grad()
    def generate(self, params: SamplingParams, on_token: Callable[[int], bool] | None = None,
                 generator: torch.Generator | None = None) -> list[int]:
        """Sample up to max_new_tokens; stops at a stop token or when on_token(token) returns True."""
        if self._logits is None:
            raise ValueError("feed the session some tokens before generating")
        stops = self.engine.stop_ids(params)
        out: list[int] = []
        budget = min(params.max_new_tokens, self.engine.max_context - self.length - 1)
        for step in range(budget):
            token = int(sample_next(self._logits, params, generator)[0])
            out.append(token)
            if token in stops or (on_token is not None and on_token(token)) or step == budget - 1:
                break
            self.feed([token])
        # The last sampled token is not in the cache yet; it goes in first with the next feed.
        self._pending = out[-1:]
        return out
