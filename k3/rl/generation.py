"""The one place where RL rollouts call the inference engine.

``generate(engine, prompts, ...)`` samples one continuation per prompt; ``group_sizes`` says which prompts
are G copies of one prompt, which the engine then prefills once and forks (SamplingParams.n), through
``engine.complete`` (continuous batching, per-token logprobs, n samples per prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.infer.sampling import SamplingParams


@dataclass
class Generated:
    """token_ids: the new tokens (the EOS that ended the turn included); logprobs: log p(token) under the
    sampling model at the sampling temperature (softmax(logits / T)), one per token, or None when the engine
    gives none; finish_reason: "stop" (EOS / stop token) or "length"; routing: with an engine that records
    routing, the experts of every token the engine fed ([MoE layers, prompt + new tokens - 1, K]), else None."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    routing: object | None = None


def sampling_params(max_new_tokens: int, temperature: float, top_p: float, seed: int | None, stop_ids: list[int],
                    n: int = 1) -> SamplingParams:
    """SamplingParams of one rollout request: n samples, each token's logprob recorded."""
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          stop_token_ids=list(stop_ids), logprobs=0, n=n)


def generate(engine, prompts: list[list[int]], max_new_tokens: list[int], temperature: float, top_p: float,
             seeds: list[int], stop_ids: list[int], group_sizes: list[int] | None = None) -> list[Generated]:
    """One continuation per prompt, in order, through ``engine.complete`` (k3.infer.Engine's).

    prompts: token id lists; max_new_tokens, seeds: one per prompt. group_sizes (optional): consecutive runs
    of identical prompts (sum == len(prompts)); each run goes to the engine as one request with n = its size
    (the prompt is prefilled once), with the seed of its first member."""
    if not prompts:
        return []
    groups = group_sizes or [1] * len(prompts)
    if sum(groups) != len(prompts):
        raise ValueError(f"group_sizes sum to {sum(groups)} but there are {len(prompts)} prompts")
    requests, params, start = [], [], 0
    for size in groups:
        requests.append(prompts[start])
        params.append(sampling_params(max_new_tokens[start], temperature, top_p, seeds[start], stop_ids, n=size))
        start += size
    generated = []
    for out in engine.complete(requests, params):
        for completion in out.outputs:
            reason = "stop" if completion.finish_reason == "stop" else "length"
            generated.append(Generated(list(completion.token_ids), completion.logprobs, reason,
                                       getattr(completion, "routing", None)))
    return generated
