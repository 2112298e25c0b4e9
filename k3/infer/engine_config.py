"""The inference engine's settings (EngineConfig) and every decision the engine makes from them, in one place.

EngineConfig holds what a caller chooses; a None field is left to plan_engine, which decides it from the model
and the device (chunk sizes, pages, prefix slots, CUDA graphs, fused weights) and returns an EnginePlan of
concrete values. On a GPU, fit_prefill_to_memory then shrinks the default prefill sizes to what the device holds
once the cache pool is allocated. The engine only carries the plan out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from k3.cli_config import option
from k3.infer.scheduler import pages_for


@dataclass
class EngineConfig:
    """Settings of one inference engine (k3.infer.Engine); None: plan_engine decides."""

    max_context: int = 4096
    """longest prompt + generation per sequence, in tokens"""
    max_batch: int = 32
    """most sequences decoding at once (KDA state slots for requests)"""
    page_size: int = field(default=32, metadata=option(cli=False))
    """tokens per MLA page"""
    prefill_chunk: int | None = field(default=None, metadata=option(cli=False))
    """longest prefill forward, a multiple of page_size (default: default_prefill_chunk's)"""
    max_step_tokens: int | None = field(default=None, metadata=option(cli=False))
    """token budget of a step, decodes counting one each (default: default_prefill_chunk's step tokens plus
    max_batch)"""
    prefill_padding: float = field(default=0.25, metadata=option(cli=False))
    """most padding in a prefill forward, as a share of its tokens: chunks of different lengths from one position
    share a forward padded to the longest (k3.infer.scheduler.prefill_forwards); 0: only equal chunks share"""
    prefix_cache: bool = field(default=True, metadata=option(negative_help="turn prefix caching off"))
    """exact prefix caching of KDA states and MLA pages across requests"""
    prefix_slots: int | None = field(default=None, metadata=option(cli=False))
    """KDA slots kept for prefix-cache states (default: max_batch with prefix_cache, else 0; 0 turns it off)"""
    num_pages: int | None = field(default=None, metadata=option(cli=False))
    """MLA pages in the pool (default: enough for max_batch full contexts, within half the free GPU memory)"""
    dtype: torch.dtype | None = field(default=None, metadata=option(name="cache_dtype", cli=False))
    """the cache pool's dtype (default: the model's)"""
    use_cuda_graphs: bool | None = field(default=None, metadata=option(cli=False))
    """replay decode steps from CUDA graphs (default: on CUDA, for bf16 weights or a model without MoE)"""
    record_routing: bool = field(default=False, metadata=option(cli=False))
    """record every fed token's experts (Completion.routing, for RL's routing replay); implies eager steps and no
    prefix cache"""
    overlap_steps: bool | None = None
    """launch each decode step before reading the previous one's tokens, so the host's work on them (the events,
    the stop checks, the server) runs while the GPU computes (decode-only steps of rows without grammars or
    penalties; a row's tokens then reach its stream one step later). Default: with CUDA-graph decode steps (on a
    CPU a step is done when it returns: nothing to overlap)"""
    gather_prompts_ms: float = 0.0
    """the longest a new prompt waits for prompts arriving with it before its first forward, so that they share
    forwards (a server's bursts); it waits only while prompts keep arriving (within 2 ms) and do not fill a
    step yet. 0: never"""
    fuse_weights: bool | None = field(default=None, metadata=option(cli=False))
    """run projections that read one input as one GEMM over one weight buffer (k3.layers.fused_weights; default: with
    CUDA graphs, for a model whose parameters are all frozen)"""

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2 (a prompt token and a new one), got {self.max_context}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0.0 <= self.gather_prompts_ms <= 10_000:
            raise ValueError(f"gather_prompts_ms must be in [0, 10000], got {self.gather_prompts_ms}")
        if not 0.0 <= self.prefill_padding < 1.0:
            raise ValueError(f"prefill_padding is a share of a forward's tokens in [0, 1), got {self.prefill_padding}")
        if self.record_routing and self.use_cuda_graphs:
            raise ValueError("record_routing needs eager decode steps; leave use_cuda_graphs unset or False")


@dataclass(frozen=True)
class EnginePlan:
    """What the engine runs with: every EngineConfig choice made concrete (see plan_engine)."""

    prefill_chunk: int
    batch_tokens: int  # tokens of a step's prefills and of a scoring forward (decoding rows add one each)
    max_step_tokens: int
    max_pages: int  # pages of one full context
    prefix_slots: int
    num_pages: int
    dtype: torch.dtype
    use_cuda_graphs: bool
    fuse_weights: bool
    default_sizes: bool  # prefill sizes from default_prefill_chunk: fit_prefill_to_memory may shrink them
    overlap_steps: bool = False
    prefill_fit: object = None  # k3.infer.memory_budget's PrefillFit, once fitted


def default_prefill_chunk(max_context: int, on_gpu: bool) -> tuple[int, int]:
    """(prefill chunk, prefill tokens a step or a scoring forward takes) for an engine of max_context tokens.

    On a GPU a prefill forward of a mid-size model is bound by the host (its launches) up to several thousand
    tokens, so the short chunk is 8,192 tokens there and 512 elsewhere (BENCHMARKS.md, engine prefill); long
    contexts take longer ones (long_prefill_chunk). A step's prefills (and a scoring forward) take four long chunks'
    tokens, or with the short chunk 16,384 on a GPU (`small` on one H100: a forward of 8 x 1,024 tokens took 84 ms
    of host time for 29 ms of kernels, so two such chunks share one forward's host cost) and 2,048 (four chunks)
    elsewhere."""
    short = 8192 if on_gpu else 512
    long_chunk = long_prefill_chunk(max_context)
    if long_chunk and long_chunk > short:
        return long_chunk, 4 * long_chunk
    return short, 16384 if on_gpu else 2048


def long_prefill_chunk(length: int) -> int | None:
    """Prefill chunk for contexts of `length` tokens: None (the engine's short default) up to 32K, then
    length/16 in multiples of 2,048, at most 65,536. Each chunk after the first up-projects MLA's keys and
    values over the whole context so far, so a 1M prompt in the default 2,048-token chunks would do that 512
    times; 16 chunks keep it cheap while one chunk's MoE intermediate stays far below one whole-prompt forward's."""
    chunk = (length // 16) // 2048 * 2048
    return min(65536, chunk) if chunk > 2048 else None


def plan_engine(config: EngineConfig, model) -> EnginePlan:
    """Every choice EngineConfig leaves open, decided from the model (its dtype, MoE layers, frozen or trained
    parameters) and its device. Before the cache pool exists; fit_prefill_to_memory follows it on a GPU."""
    device = next(model.parameters()).device
    dtype = config.dtype or next(model.parameters()).dtype
    on_gpu = device.type == "cuda"
    page_size = config.page_size
    default_sizes = config.prefill_chunk is None
    prefill_chunk, batch_tokens = config.prefill_chunk, None
    if default_sizes:
        prefill_chunk, batch_tokens = default_prefill_chunk(config.max_context, on_gpu)
    prefill_chunk = max(page_size, (prefill_chunk // page_size) * page_size)
    batch_tokens = batch_tokens or 4 * prefill_chunk
    max_pages = pages_for(config.max_context, page_size)
    # Recording routes needs each prompt's own prefill (a prefix-cache hit would skip it).
    prefix_cache = config.prefix_cache and not config.record_routing
    prefix_slots = (config.max_batch if prefix_cache else 0) if config.prefix_slots is None else config.prefix_slots
    num_pages = config.num_pages
    if num_pages is None:
        num_pages = config.max_batch * max_pages + (prefix_slots * max_pages // 2)
        if on_gpu:
            # Full contexts for every slot can outgrow the GPU at long contexts: keep the pages within half of the
            # free memory; admission then waits for pages instead of the allocation failing.
            mc = model.config
            page_bytes = (mc.layer_types.count("mla") * page_size * (mc.kv_lora_rank + mc.qk_rope_head_dim)
                          * dtype.itemsize)
            free, _ = torch.cuda.mem_get_info(device)
            num_pages = max(max_pages, min(num_pages, int(0.5 * free) // max(page_bytes, 1)))
    use_cuda_graphs = config.use_cuda_graphs
    if config.record_routing:
        use_cuda_graphs = False  # recording runs Python hooks in every forward
    elif use_cuda_graphs is None:
        # The MoE layers capture only on the bf16 grouped-GEMM path; the expert loop (other dtypes) reads its counts
        # back to the host, which a graph cannot hold.
        use_cuda_graphs = on_gpu and (dtype == torch.bfloat16 or not model.routers())
    fuse_weights = config.fuse_weights
    if fuse_weights is None:
        # Worth it where launches set the step (graphs); only for frozen copies, whose weights the engine alone
        # reads (a model being trained keeps its separate projections either way).
        fuse_weights = use_cuda_graphs and not any(p.requires_grad for p in model.parameters())
    max_step_tokens = config.max_step_tokens or batch_tokens + config.max_batch
    overlap_steps = config.overlap_steps
    if overlap_steps is None:
        overlap_steps = bool(use_cuda_graphs)  # the GPU runs a replay while the host books the step before
    return EnginePlan(prefill_chunk, batch_tokens, max_step_tokens, max_pages, prefix_slots, num_pages, dtype,
                      bool(use_cuda_graphs), bool(fuse_weights), default_sizes and config.max_step_tokens is None,
                      overlap_steps=bool(overlap_steps))


def fit_prefill_to_memory(plan: EnginePlan, config: EngineConfig, model) -> EnginePlan:
    """On a GPU, with the default sizes: the prefill chunk and step tokens shrunk to what is left of the device after
    the weights and the cache pool (k3.infer.memory_budget); cached blocks the allocator holds count as free."""
    device = next(model.parameters()).device
    if device.type != "cuda" or not plan.default_sizes:
        return plan
    from k3.infer.memory_budget import fit_prefill

    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    fit = fit_prefill(model.config, config.max_context, plan.prefill_chunk, plan.batch_tokens, free,
                      plan.dtype.itemsize, quantum=max(config.page_size, 2048))
    chunk = max(config.page_size, fit.chunk // config.page_size * config.page_size)
    return dataclasses.replace(plan, prefill_chunk=chunk, batch_tokens=fit.step_tokens,
                               max_step_tokens=fit.step_tokens + config.max_batch, prefill_fit=fit)
