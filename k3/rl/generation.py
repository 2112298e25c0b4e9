"""The one place where RL rollouts call the inference engine.

``generate(engine, prompts, ...)`` samples one continuation per prompt; ``group_sizes`` says which prompts
are G copies of one prompt, which the engine then prefills once and forks (SamplingParams.n). It uses
``engine.complete`` (continuous batching, per-token logprobs, n samples per prompt) when the engine has it,
and otherwise the length-grouped ``Engine.generate_ids`` (no logprobs: the trainer's recompute stands in).
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
                    n: int = 1, logprobs: bool = True) -> SamplingParams:
    """SamplingParams for the engine at hand: the new engine's logprobs/n fields only when it has them."""
    fields = SamplingParams.__dataclass_fields__
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  stop_token_ids=list(stop_ids))
    if "logprobs" in fields and logprobs:
        kwargs["logprobs"] = 0
    if "n" in fields:
        kwargs["n"] = n
    return SamplingParams(**kwargs)


def engine_has_complete(engine) -> bool:
    return callable(getattr(engine, "complete", None)) and "n" in SamplingParams.__dataclass_fields__


def generate(engine, prompts: list[list[int]], max_new_tokens: list[int], temperature: float, top_p: float,
             seeds: list[int], stop_ids: list[int], group_sizes: list[int] | None = None) -> list[Generated]:
    """One continuation per prompt, in order.

    prompts: token id lists; max_new_tokens, seeds: one per prompt. group_sizes (optional): consecutive runs
    of identical prompts (sum == len(prompts)); each run goes to the engine as one request with n = its size
    when the engine can fork (the prompt is prefilled once), with the seed of its first member."""
    if not prompts:
        return []
    stops = set(stop_ids)
    if engine.tokenizer is not None and engine.tokenizer.eos_token_id is not None:
        stops.add(engine.tokenizer.eos_token_id)
    if engine_has_complete(engine):
        groups = group_sizes or [1] * len(prompts)
        if sum(groups) != len(prompts):
            raise ValueError(f"group_sizes sum to {sum(groups)} but there are {len(prompts)} prompts")
        requests, params, start = [], [], 0
        for size in groups:
            requests.append(prompts[start])
            params.append(sampling_params(max_new_tokens[start], temperature, top_p, seeds[start], stop_ids, n=size))
            start += size
        outputs = engine.complete(requests, params)
        generated = []
        for out in outputs:
            for completion in out.outputs:
                reason = "stop" if completion.finish_reason == "stop" else "length"
                generated.append(Generated(list(completion.token_ids), completion.logprobs, reason,
                                           getattr(completion, "routing", None)))
        return generated
    # Today's engine: one sampling params (and one generator) per call, so prompts are batched by their
    # token budget; each batch's seed is its first member's.
    results: list[Generated | None] = [None] * len(prompts)
    by_budget: dict[int, list[int]] = {}
    for index, budget in enumerate(max_new_tokens):
        by_budget.setdefault(budget, []).append(index)
    for budget, members in sorted(by_budget.items()):
        params = sampling_params(budget, temperature, top_p, seeds[members[0]], stop_ids, logprobs=False)
        outputs = engine.generate_ids([prompts[i] for i in members], params)
        for index, ids in zip(members, outputs):
            reason = "stop" if ids and ids[-1] in stops else "length"
            results[index] = Generated(list(ids), None, reason)
    return results
