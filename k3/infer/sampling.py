"""Next-token choice on the device, for a batch whose rows each carry their own sampling parameters.

Per row: repetition / presence / frequency penalties, temperature (0 = greedy), top-k, top-p (nucleus),
min-p, and a seed. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly
from p; a seeded row draws its E from its own generator, so a seeded request gives the same tokens alone or
in any batch. Logprobs are those of the distribution a row samples from before its filters: log_softmax of the
logits divided by the row's temperature (temperature 1 for greedy rows), no filters, no penalties, as verl, TRL
and slime take them; RL's trainer recomputes them at the same temperature (k3.rl.policy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; drop tokens below min_p * (probability of the most likely token)
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages every token already in prompt or output
    presence_penalty: float = 0.0  # subtracted once from the logit of each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    stop: list[str] = field(default_factory=list)  # stop strings (removed from the text)
    seed: int | None = None
    logprobs: int | None = None  # None = off; 0 = the sampled token's logprob; k > 0 = also the top k
    n: int = 1  # samples of one prompt (prefilled once, cache forked)
    grammar: object | None = None  # k3.infer.structured.Grammar: only tokens it allows are sampled

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            need(isinstance(getattr(self, name), (int, float)) and math.isfinite(getattr(self, name)),
                 f"{name} must be a finite number, got {getattr(self, name)!r}")
        need(self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        need(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got "
                                                               f"{self.top_k!r}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        need(0.01 <= self.repetition_penalty <= 100,
             f"repetition_penalty must be in [0.01, 100] (1 = off), got {self.repetition_penalty}")
        need(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
             f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        need(isinstance(self.n, int) and 1 <= self.n <= 128, f"n must be an integer in [1, 128], got {self.n!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature leave float32's range: such a temperature means greedy anyway.
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [B, V] -> logits with everything outside the top-k / the top-p nucleus set to -inf (one value for
    all rows). The most likely token always survives."""
    rows = logits.shape[0]
    return filter_rows(logits, torch.full((rows,), top_k, device=logits.device),
                       torch.full((rows,), float(top_p), device=logits.device),
                       torch.zeros(rows, device=logits.device))


def filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                sort: bool | None = None, use_min_p: bool | None = None) -> torch.Tensor:
    """logits [B, V] float; top_k [B] int (0 = off), top_p [B] float, min_p [B] float -> filtered logits.
    sort / use_min_p say whether any row filters by rank / min-p (given by callers that know it on the host,
    so that no device value is read back)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if sort is None:
        sort = bool((top_k > 0).any()) or bool((top_p < 1).any())
    if use_min_p is None:
        use_min_p = bool((min_p > 0).any())
    if sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop_sorted = rank >= k[:, None]
        probs = sorted_logits.softmax(-1)
        # A token is dropped when the tokens strictly more likely already cover top_p.
        drop_sorted |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop_sorted[:, 0] = False
        logits.masked_fill_(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    if use_min_p:
        probs = logits.softmax(-1)
        logits.masked_fill_(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def apply_penalties(logits_V: torch.Tensor, params: SamplingParams, prompt_counts_V: torch.Tensor | None,
                    output_counts_V: torch.Tensor) -> torch.Tensor:
    """One row's penalties. prompt_counts_V / output_counts_V: token counts [V] (prompt may be None)."""
    if params.repetition_penalty != 1:
        seen = output_counts_V > 0
        if prompt_counts_V is not None:
            seen |= prompt_counts_V > 0
        penalised = torch.where(logits_V > 0, logits_V / params.repetition_penalty,
                                logits_V * params.repetition_penalty)
        logits_V = torch.where(seen, penalised, logits_V)
    if params.presence_penalty:
        logits_V = logits_V - params.presence_penalty * (output_counts_V > 0).to(logits_V.dtype)
    if params.frequency_penalty:
        logits_V = logits_V - params.frequency_penalty * output_counts_V.to(logits_V.dtype)
    return logits_V


@dataclass
class SampledBatch:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]


def row_values(values: list, device: torch.device) -> torch.Tensor:
    """One value per row on the device. On CUDA through pinned memory without waiting: a copy from pageable memory
    waits for the stream, which would stall the host behind the step it just launched (the engine's overlap)."""
    host = torch.tensor(values)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                penalty_counts: list[tuple[torch.Tensor | None, torch.Tensor] | None] | None = None,
                want_logprobs: bool = False, top_n: int = 0) -> SampledBatch:
    """logits [B, V] (any float dtype) and one SamplingParams per row -> the sampled tokens (+ logprobs).
    penalty_counts[r] is (prompt counts, output counts) for rows whose params penalise, else None."""
    raw = logits.float()
    device = raw.device
    work = raw
    if penalty_counts is not None and any(c is not None for c in penalty_counts):
        work = raw.clone()
        for row, counts in enumerate(penalty_counts):
            if counts is not None:
                work[row] = apply_penalties(work[row], params[row], counts[0], counts[1])
    tokens = work.argmax(-1)
    temperature = None
    if not all(p.greedy for p in params):
        greedy = row_values([p.greedy for p in params], device)
        temperature = row_values([1.0 if p.greedy else p.temperature for p in params], device)
        vocab = work.shape[-1]
        filtered = filter_rows(work / temperature[:, None],
                               row_values([min(p.top_k, vocab) for p in params], device),
                               row_values([p.top_p for p in params], device),
                               row_values([p.min_p for p in params], device),
                               sort=any(p.top_k > 0 or p.top_p < 1 for p in params),
                               use_min_p=any(p.min_p > 0 for p in params))
        probs = filtered.softmax(-1)
        race = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(generators):
            if generator is not None and not params[row].greedy:
                race[row] = torch.empty(probs.shape[1], device=device).exponential_(generator=generator)
        sampled = (probs / race).argmax(-1)
        tokens = torch.where(greedy, tokens, sampled)
    logprobs = top_ids = top_values = None
    if want_logprobs:
        log_probs = (raw if temperature is None else raw / temperature[:, None]).log_softmax(-1)
        logprobs = log_probs.gather(1, tokens[:, None])[:, 0]
        if top_n > 0:
            top_values, top_ids = log_probs.topk(top_n, dim=-1)
    return SampledBatch(tokens, logprobs, top_ids, top_values)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B], every row with the same params (and generator)."""
    return sample_rows(logits, [params] * logits.shape[0], [generator] * logits.shape[0]).tokens
