"""Prefill sizes from the device's free memory: the longest prefill chunk and the tokens a step (or a scoring
forward) takes, so that the largest transient of a forward fits beside the weights and the cache pool.

max_context alone sets the chunk that keeps a long prompt cheap (k3.infer.engine.long_prefill_chunk: 64K tokens
at 1M); on an 80 GB card that chunk, four of them in one scoring forward, and the keys and values MLA expands
over the whole context so far may not fit where they fit on a 141 GB one. `fit_prefill` keeps the chunk and the
step budget where they are when memory allows and shrinks them (in multiples of `quantum` tokens) when not.

The per-token cost is an estimate from the config, generous on purpose (an allocation that fails costs the whole
request; a chunk half as long costs a little speed): the widest intermediate of a layer (routed experts' GLU
in and out for every chosen expert, the dense MLP, KDA's projections and gates in fp32, MLA's heads), twice
(an op's output is allocated before its input is freed), plus the residual stream's block partials. Unit-tested
with fake free-memory numbers; on a GPU the engine passes torch.cuda.mem_get_info's.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK = 2048  # below this a long prompt takes too many forwards; the engine does not go lower on its own


@dataclass(frozen=True)
class PrefillFit:
    chunk: int  # longest prefill forward, tokens
    step_tokens: int  # prefill tokens a step (or a scoring forward) takes
    bytes_per_token: int  # the estimate used
    context_bytes: int  # what a chunk at the end of the longest context adds whatever its length
    budget_bytes: int  # the share of free memory the forward may use


def prefill_bytes_per_token(config, itemsize: int) -> int:
    """Transient bytes one prefill token needs at the widest point of a layer (an estimate; see the module)."""
    fp32 = 4
    routed = config.num_experts_per_tok * (3 * config.moe_intermediate_size * itemsize
                                           + 2 * config.moe_intermediate_size * fp32
                                           + 2 * getattr(config, "moe_latent_size", config.hidden_size) * itemsize)
    dense = 3 * config.intermediate_size * itemsize + 2 * config.intermediate_size * fp32
    kda = config.kda_num_heads * config.kda_head_dim * 8 * fp32
    mla_width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    mla = 4 * config.mla_num_heads * mla_width * itemsize
    stream = (config.num_layers // max(1, getattr(config, "attn_res_block_size", 1)) + 4) * config.hidden_size * fp32
    return 2 * max(routed, dense, kda, mla) + stream


def context_bytes(config, context: int, itemsize: int) -> int:
    """Bytes a chunk at position `context` needs whatever its own length: MLA expands keys and values over the
    whole context so far (latents gathered, up-projected, keys joined with their rope part, cast for SDPA)."""
    if "mla" not in getattr(config, "layer_types", ["mla"]):
        return 0
    width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    return context * (3 * config.mla_num_heads * width + latent) * itemsize


def fit_prefill(config, max_context: int, chunk: int, step_tokens: int, free_bytes: int, itemsize: int,
                fraction: float = 0.6, quantum: int = MIN_CHUNK) -> PrefillFit:
    """The chunk and step budget (at most `chunk` and `step_tokens`) whose forward fits `fraction` of
    `free_bytes` (free device memory after the weights and the cache pool). Never below one quantum (or the
    given chunk when that is shorter): a device too small for that fails at the allocation, with its numbers."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if chunk < 1 or step_tokens < 1 or free_bytes < 0:
        raise ValueError(f"chunk and step_tokens must be >= 1 and free_bytes >= 0; got {chunk}, {step_tokens}, "
                         f"{free_bytes}")
    per_token = prefill_bytes_per_token(config, itemsize)
    fixed = context_bytes(config, max_context, itemsize)
    budget = int(fraction * free_bytes)
    fits = max(0, budget - fixed) // per_token  # tokens of one forward that fit
    floor = min(chunk, quantum)

    def fitted(tokens: int) -> int:
        if tokens <= fits:
            return tokens
        return max(floor, fits // quantum * quantum)

    new_chunk = fitted(chunk)
    new_step = max(new_chunk, fitted(step_tokens))
    return PrefillFit(new_chunk, new_step, per_token, fixed, budget)


def release_cached_memory() -> None:
    """Give the blocks the CUDA allocator caches back to the device (between the lengths of an evaluation: a
    128K run left 24 GiB reserved but unused, which the next engine's sizing and largest allocation need)."""
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
