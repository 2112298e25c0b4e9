"""`echo` for /v1/completions: the prompt returned in front of the completion, and with `logprobs` the
prompt's own token logprobs (the first token has none: null, as OpenAI gives it), computed by the engine's
score() (one packed forward, off the event loop, in process or in the engine's process). With max_tokens 0
nothing is generated: the loglikelihood requests of evaluation harnesses (lm-eval-harness's local-completions)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from k3.infer.protocol import reported_logprob


async def score_prompts(async_engine, prompts: list[list[int]], top_k: int) -> list:
    """engine.score of every prompt from its second token -> list of k3.infer.engine.ScoreOutput."""
    return await asyncio.to_thread(async_engine.score, prompts, [1] * len(prompts), top_k)


def prompt_logprobs(ids: list[int], scored, top: int, token_text: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's completions logprobs object for the prompt ids (offsets from 0)."""
    tokens = [token_text(t) for t in ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    tops = [None] + [{token_text(t): reported_logprob(lp) for t, lp in row[:top]}
                     for row in (scored.top_logprobs or [[] for _ in scored.logprobs])]
    return {"tokens": tokens, "token_logprobs": [None] + [reported_logprob(lp) for lp in scored.logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(prompt: dict[str, Any] | None, completion: dict[str, Any] | None, shift: int) -> dict | None:
    """The prompt's logprobs followed by the completion's (its offsets moved past the prompt's text)."""
    if prompt is None:
        return completion
    if completion is None:
        return prompt
    return {"tokens": prompt["tokens"] + completion["tokens"],
            "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
            "text_offset": prompt["text_offset"] + [o + shift for o in completion["text_offset"]]}
