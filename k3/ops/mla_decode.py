"""MLA's absorbed (latent-space) attention for decode: a split-KV flash-decode Triton kernel and its einsum twin.

    scores[b, h, t, s] = (q_latent[b, h, t] . latent[b, s] + q_rope[b, t, h] . k_rope[b, s]) * scale
    out_latent[b, h, t] = softmax_s(scores masked)[b, h, t] @ latent[b]

q_latent = q_nope W_uk is a small GEMM the caller runs (k3.layers.mla); W_uv is applied to out_latent after.

Why a kernel: the einsum twin reads the latent cache twice (once for the scores, once for the values) and writes
and reads the [B, H, T, S] scores and probabilities in between. At `small`'s shapes (8 heads, kv_lora_rank 256,
rope 64) on one H200, batch 64 with an 8K-token cache, the einsum path was measured at ~690 us over the 4 MLA
layers against ~300 us to read the latent bytes once. The kernel (FlashDecoding style) reads each cached latent /
k_rope row once, for all heads of its batch row together: the grid is (query rows B*T, KV splits, head blocks),
each program streams blocks of slots keeping an fp32 online softmax (running max and sum) and an fp32 [H, R]
accumulator, and a second small kernel joins the splits by log-sum-exp (with one split the first kernel writes
the output itself: one launch). The split count grows until the GPU has about two programs per multiprocessor.
Measured on one H200 (bench/mla_decode.py, `small`, 8K): BENCHMARKS.md, round ten.

Masks, as the callers give them: None with `past` (causal: query t sees slots < past + t + 1; with past 0 and one
query, every slot), a [T, S] boolean (StaticCache: the filled slots, computed on the device, same for every row),
or a [B, 1, T, S] boolean (the engine's cache pool: each row at its own position). The boolean masks are read by
the kernel through strides (stride 0 broadcasts), so nothing is synchronised with the host and a decode step
stays capturable as a CUDA graph. Hidden slots are not loaded at all (masked loads), so a static cache's unfilled
capacity costs only its mask bytes, and garbage (even NaN) there cannot reach the output, unlike the einsum twin,
whose zero probabilities still multiply it. A query row with no visible slot gives NaN, as the twin's softmax
over all -inf does (0 / 0 in the kernel); decode never produces such a row.

Precision: the kernel keeps scores and probabilities in fp32 and casts the probabilities to the cache's dtype
for the value product, as flash attention does; the twin rounds the scores to q's dtype first (bf16 einsum).

Switch: K3_MLA_DECODE=auto|triton|torch (k3.kernels `mla_decode`; `einsum` is an old name of torch). auto takes the kernel for
CUDA tensors in bf16/fp16, at most DECODE_MAX_TOKENS queries per row and no autograd graph (inference), with a mask
form above, when triton imports; the einsum twin otherwise (training and CPU do not change). An auto-chosen kernel that
Triton cannot compile warns once and that variant runs the twin from then on
(k3.ops.fused_backend.with_torch_fallback); a forced `triton` raises. Under torch.compile the launcher is the
custom op `k3::mla_decode_triton`, opaque to dynamo.
The tests (tests/ops/test_mla_decode_triton.py) run the kernels in Triton's CPU interpreter.

Shape suffixes: B batch rows, H heads, T query tokens per row, S cached slots, R kv_lora_rank, E rope width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3 import kernels
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.norm import compute_dtype
from k3.ops.triton_support import interpreting, kernel_module, multiprocessors, triton_importable

DECODE_MAX_TOKENS = 4  # auto takes the kernel for up to this many queries per row (decode, speculative steps)
ALL_VISIBLE = 1 << 30  # `visible_before` of an unmasked call: no slot index reaches it



def decode_backend() -> str:
    """The `mla_decode` switch: "auto", "triton" or "torch" (the einsum twin)."""
    return kernels.choice("mla_decode")


def causal_mask(length: int, total: int, past: int, device) -> torch.Tensor | None:
    """[T, S] causal mask for `length` queries after `past` cached tokens; None when every slot is visible
    (past 0, one query) or plain lower-triangular causality does (past 0, several queries)."""
    if past == 0:
        return None
    query_pos = torch.arange(past, past + length, device=device)
    return query_pos[:, None] >= torch.arange(total, device=device)[None, :]


def visible_before(past: int, length: int) -> int:
    """Without a mask, query t sees slots < visible_before + t: the einsum twin's causal rule."""
    return past + 1 if past > 0 or length > 1 else ALL_VISIBLE


def latent_attention_einsum(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent_BSR: torch.Tensor,
                            k_rope_BSE: torch.Tensor, mask: torch.Tensor | None, past: int,
                            scale: float) -> torch.Tensor:
    """The PyTorch twin (training, CPU): out_latent [B, H, T, R] in q's dtype."""
    length, total = q_latent_BHTR.shape[2], latent_BSR.shape[1]
    dtype = q_latent_BHTR.dtype
    scores = torch.einsum("bhtr,bsr->bhts", q_latent_BHTR, latent_BSR.to(dtype))
    scores = scores + torch.einsum("bthe,bse->bhts", q_rope_BTHE, k_rope_BSE.to(dtype))
    scores = scores.to(compute_dtype(scores)) * scale
    if mask is None:
        mask = causal_mask(length, total, past, q_latent_BHTR.device)
    if mask is None and length > 1:
        mask = torch.ones(length, total, dtype=torch.bool, device=q_latent_BHTR.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(dtype)
    return torch.einsum("bhts,bsr->bhtr", probs, latent_BSR.to(dtype))


def _kernels(interpret: bool):
    """(split, merge), imported on first use in the given interpreter mode (k3.ops.triton_support)."""
    module = kernel_module("k3.ops.mla_decode_kernels", interpret)
    return module.mla_decode_split, module.mla_decode_merge


def default_block_s(programs_per_split: int, rank: int) -> int:
    """Slots per block. Measured on one H200 at rank 256, 8K slots (bench/mla_decode.py sweeps): with one row
    the splits are long and 128 slots took 23.6 us against 29.8 for 64 and 50.4 for 32. With 64 rows (8 heads),
    the wide sweep's best was 16 slots on 2 warps with twice the splits (programs_per_sm): 147 us a layer,
    against 162-166 for 32 slots on 4 warps and 169-254 for 64 (floor 80 us). Wider latents keep 32 (registers)."""
    if rank > 256:
        return 32
    return 128 if programs_per_split < 16 else 16


def programs_per_sm(block_s: int) -> int:
    """Programs per multiprocessor the split count aims at. Measured (the wide sweep at 64 rows): 16-slot blocks
    took 147 us with 10 splits (about four programs per SM), 213 with 5 and 170 with 20; 32-slot blocks did best
    with the heuristic's two."""
    return 4 if block_s <= 16 else 2


def num_splits(programs_per_split: int, total: int, block_s: int, num_sms: int = 132,
               per_sm: int = 2) -> tuple[int, int]:
    """(splits, blocks of slots per split): split S until the grid has about `per_sm` programs per
    multiprocessor, keeping at least two blocks per split (each split adds an fp32 [H, R] partial to write and
    merge)."""
    blocks = max(1, -(-total // block_s))
    splits = max(1, min(-(-per_sm * num_sms // max(1, programs_per_split)), blocks // 2))
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split


def mask_BTS(mask: torch.Tensor, batch: int, length: int, total: int) -> torch.Tensor:
    """A caller's mask, [T, S] or [B, 1, T, S] (as the twin broadcasts it over [B, H, T, S]), as a [B, T, S]
    view; size-1 rows broadcast (stride 0)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"the attention mask must be boolean (True = visible), got {mask.dtype}")
    if mask.dim() == 4 and mask.shape[1] == 1:
        mask = mask[:, 0]
    elif mask.dim() == 4:
        raise ValueError(f"a 4-d mask must be [B, 1, T, S] (one for all heads), got {tuple(mask.shape)}")
    elif mask.dim() == 2:
        mask = mask[None]
    else:  # a 3-d mask would broadcast over [B, H, T, S] as [H, T, S] in the twin: say which form is meant
        raise ValueError(f"the mask must be [T, S] or [B, 1, T, S], got {tuple(mask.shape)}")
    try:
        return mask.broadcast_to(batch, length, total)
    except RuntimeError:
        raise ValueError(f"mask {tuple(mask.shape)} does not broadcast to [B, T, S] = "
                         f"{(batch, length, total)}") from None


def latent_attention_triton_eager(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent_BSR: torch.Tensor,
                                  k_rope_BSE: torch.Tensor, mask: torch.Tensor | None, visible_before: int,
                                  scale: float, block_s: int | None = None, splits: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  limits_B: torch.Tensor | None = None) -> torch.Tensor:
    """out_latent [B, H, T, R] in q_latent's dtype. Without `mask`, query t sees slots < visible_before + t, or
    with `limits_B` ([B] integers on the device) slots < limits_B[b] + t: the kernel then visits only the
    blocks up to each row's limit and loads no mask (`mask` must be None with it).
    block_s / splits / num_warps / num_stages default to the heuristics (tests and the benchmark set them)."""
    batch, heads, length, rank = q_latent_BHTR.shape
    total, rope = latent_BSR.shape[1], k_rope_BSE.shape[2]
    if q_rope_BTHE.shape != (batch, length, heads, rope) or latent_BSR.shape != (batch, total, rank) \
            or k_rope_BSE.shape != (batch, total, rope):
        raise ValueError(f"shapes: q_latent [B, H, T, R] {tuple(q_latent_BHTR.shape)}, q_rope [B, T, H, E] "
                         f"{tuple(q_rope_BTHE.shape)}, latent [B, S, R] {tuple(latent_BSR.shape)}, k_rope "
                         f"[B, S, E] {tuple(k_rope_BSE.shape)} do not agree")
    dtype = q_latent_BHTR.dtype
    if limits_B is not None:
        if mask is not None:
            raise ValueError("give the visible slots as a mask or as limits_B, not both")
        if limits_B.shape != (batch,):
            raise ValueError(f"limits_B must be [B] = [{batch}], got {tuple(limits_B.shape)}")
        limits_B = limits_B.to(torch.int32)  # a stride-0 broadcast (one position for every row) is read as such
    mask_BTS_ = None if mask is None else mask_BTS(mask, batch, length, total)
    return _launch(q_latent_BHTR, q_rope_BTHE.to(dtype), latent_BSR.to(dtype), k_rope_BSE.to(dtype), total,
                   mask_BTS_, visible_before, scale, block_s, splits, num_warps, limits_B=limits_B,
                   num_stages=num_stages)


def _launch(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
            total: int, mask_BTS_: torch.Tensor | None, visible_before: int, scale: float, block_s: int | None,
            splits: int | None, num_warps: int | None, table_BP: torch.Tensor | None = None,
            limits_B: torch.Tensor | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The split and merge launches. latent / k_rope: [B, S, width], or with table_BP the pool's
    [pages, page_size, width] (slot s of row b in page table_BP[b, s // page_size]). limits_B: query t of row b
    sees slots < limits_B[b] + t (else visible_before + t, or the mask)."""
    import triton

    batch, heads, length, rank = q_latent_BHTR.shape
    rope = k_rope.shape[-1]
    out = q_latent_BHTR.new_empty(batch, heads, length, rank)
    if out.numel() == 0:
        return out
    if total == 0:  # no slot at all: the twin's product over an empty axis is 0 (cannot happen with a cache)
        return out.zero_()
    if mask_BTS_ is not None:
        mask_u8 = mask_BTS_.view(torch.uint8)
        mask_strides = mask_u8.stride()
    else:
        mask_u8, mask_strides = q_latent_BHTR, (0, 0, 0)  # never read (HAS_MASK False)
    paged = table_BP is not None
    table = table_BP if paged else q_latent_BHTR  # never read unless PAGED / HAS_LIMITS
    limits = limits_B if limits_B is not None else q_latent_BHTR
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    block_r = max(16, triton.next_power_of_2(rank))
    block_e = max(16, triton.next_power_of_2(rope))
    head_blocks = -(-heads // block_h)
    rows = batch * length
    block_s = block_s or default_block_s(rows * head_blocks, rank)
    num_sms = multiprocessors(q_latent_BHTR.device.index) if q_latent_BHTR.is_cuda else 132
    if splits is None:
        splits, per_split = num_splits(rows * head_blocks, total, block_s, num_sms, programs_per_sm(block_s))
    else:  # as asked, less where the last splits would be empty
        blocks = -(-total // block_s)
        per_split = -(-blocks // splits)
        splits = -(-blocks // per_split)
    single = splits == 1
    # Partials [rows, splits, H, R] and (max, sum) [rows, splits, 2, H]; one split needs none (one element, never
    # read, keeps the pointer valid).
    part = out.new_empty((1,) if single else (rows, splits, heads, rank), dtype=torch.float32)
    ml = out.new_empty((1,) if single else (rows, splits, 2, heads), dtype=torch.float32)
    interpret = interpreting()
    split_kernel, merge_kernel = _kernels(interpret)
    num_warps = num_warps or (2 if block_s <= 16 else 4 if block_h * block_r <= 16 * 256 else 8)
    split_kernel[(rows, splits, head_blocks)](
        q_latent_BHTR, q_rope_BTHE, latent, k_rope, mask_u8, out, part, ml,
        *q_latent_BHTR.stride(), *q_rope_BTHE.stride(), *latent.stride(), *k_rope.stride(), *mask_strides,
        *out.stride(), length, total, min(int(visible_before), ALL_VISIBLE), per_split, splits,
        float(scale) * 1.4426950408889634,  # log2(e): the kernel's softmax runs in base 2
        table, *(table.stride()[:2] if paged else (0, 0)), limits, limits.stride(0) if limits_B is not None else 0,
        HEADS=heads, RANK=rank, ROPE=rope, HAS_MASK=mask_BTS_ is not None, SINGLE=single, UPCAST=interpret,
        IEEE=q_latent_BHTR.dtype == torch.float32 and not interpret, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_E=block_e, BLOCK_S=block_s, PAGED=paged, PAGE=latent.shape[1] if paged else 1,
        HAS_LIMITS=limits_B is not None, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}))
    if not single:
        merge_kernel[(rows, head_blocks)](part, ml, out, *out.stride(), length, splits, HEADS=heads, RANK=rank,
                                          BLOCK_H=block_h, BLOCK_R=block_r, num_warps=4)
    return out


@torch.library.custom_op("k3::mla_decode_triton", mutates_args=())
def mla_decode_triton_op(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent_BSR: torch.Tensor,
                         k_rope_BSE: torch.Tensor, mask: torch.Tensor | None, visible_before: int,
                         scale: float, limits_B: torch.Tensor | None = None) -> torch.Tensor:
    return latent_attention_triton_eager(q_latent_BHTR, q_rope_BTHE, latent_BSR, k_rope_BSE, mask, visible_before,
                                         scale, limits_B=limits_B)


@mla_decode_triton_op.register_fake
def _(q_latent_BHTR, q_rope_BTHE, latent_BSR, k_rope_BSE, mask, visible_before, scale, limits_B=None):
    return q_latent_BHTR.new_empty(q_latent_BHTR.shape)


def latent_attention_triton(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent_BSR: torch.Tensor,
                            k_rope_BSE: torch.Tensor, mask: torch.Tensor | None, past: int,
                            scale: float, limits_B: torch.Tensor | None = None) -> torch.Tensor:
    """Same arguments and result as latent_attention_einsum, inference only (no backward). With `limits_B`
    (see latent_attention) the mask is not read."""
    before = visible_before(past, q_latent_BHTR.shape[2])
    mask = None if limits_B is not None else mask
    if torch.compiler.is_compiling():  # dynamo cannot trace the launcher; the op is one opaque call in the graph
        return mla_decode_triton_op(q_latent_BHTR, q_rope_BTHE, latent_BSR, k_rope_BSE, mask, before, scale,
                                    limits_B)
    return latent_attention_triton_eager(q_latent_BHTR, q_rope_BTHE, latent_BSR, k_rope_BSE, mask, before, scale,
                                         limits_B=limits_B)


def triton_pays(q_latent_BHTR: torch.Tensor, latent_BSR: torch.Tensor, mask: torch.Tensor | None,
                *weights: torch.Tensor) -> bool:
    """Auto-selection: CUDA, half precision, decode-sized T, a mask form the kernel reads, no autograd graph."""
    if not (q_latent_BHTR.is_cuda and q_latent_BHTR.dtype in (torch.bfloat16, torch.float16)
            and q_latent_BHTR.shape[2] <= DECODE_MAX_TOKENS):
        return False
    if mask is not None and not (mask.dtype == torch.bool and (mask.dim() == 2 or
                                                               (mask.dim() == 4 and mask.shape[1] == 1))):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_latent_BHTR, latent_BSR, *weights)):
        return False
    return triton_importable()


def latent_attention(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent_BSR: torch.Tensor,
                     k_rope_BSE: torch.Tensor, mask: torch.Tensor | None, past: int, scale: float,
                     limits_B: torch.Tensor | None = None) -> torch.Tensor:
    """out_latent [B, H, T, R] through the backend K3_MLA_DECODE picks (see the module docstring).
    limits_B: the same visible slots as `mask` in the kernel's form (a static cache's: query t of row b sees
    slots < limits_B[b] + t), so the kernel skips the unfilled capacity and loads no mask; the twin reads
    `mask`."""
    args = (q_latent_BHTR, q_rope_BTHE, latent_BSR, k_rope_BSE, mask, past, scale)
    backend = decode_backend()
    if backend == "triton":
        return latent_attention_triton(*args, limits_B)
    if backend == "auto" and triton_pays(q_latent_BHTR, latent_BSR, mask, q_rope_BTHE, k_rope_BSE):
        variant = ("mla_decode_triton", q_latent_BHTR.shape[1], q_latent_BHTR.shape[3], k_rope_BSE.shape[2],
                   q_latent_BHTR.dtype)
        return with_torch_fallback(variant, lambda: latent_attention_triton(*args, limits_B),
                                   lambda: latent_attention_einsum(*args))
    return latent_attention_einsum(*args)


# --- the engine's paged cache, read where it lies -------------------------------------------------------------

class PagedLatents(NamedTuple):
    """An MLA layer's cache in the engine's pool, as a decode step reads it: latent [pages, page_size, R] and
    k_rope [pages, page_size, E] (the whole pool of that layer), the rows' page tables [B, P] and each row's
    first new position [B] (query t of row b sees slots <= positions[b] + t)."""

    latent_NPR: torch.Tensor
    k_rope_NPE: torch.Tensor
    table_BP: torch.Tensor
    positions_B: torch.Tensor


def gather_latents(pages: PagedLatents, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' first `tokens` slots (the whole table by default) copied out of the pages holding them: latent
    [B, S, R] and k_rope [B, S, E]."""
    size = pages.latent_NPR.shape[1]
    table = pages.table_BP if tokens is None else pages.table_BP[:, :-(-tokens // size)]
    batch, slots = table.shape[0], table.shape[1] * size
    latent = pages.latent_NPR[table].view(batch, slots, -1)
    k_rope = pages.k_rope_NPE[table].view(batch, slots, -1)
    return (latent, k_rope) if tokens is None else (latent[:, :tokens], k_rope[:, :tokens])


def gather_pages(pages: PagedLatents, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' pages copied out (gather_latents) and the visible mask [B, 1, T, S] of `length` queries per row:
    T x S booleans, for decode's few queries only (a 48K-token prefill chunk at 1M context would make 48 GiB)."""
    latent, k_rope = gather_latents(pages)
    position_BT = pages.positions_B[:, None] + torch.arange(length, device=latent.device)
    slots_S = torch.arange(latent.shape[1], device=latent.device)
    return latent, k_rope, (slots_S[None, None, :] <= position_BT[:, :, None])[:, None]


def latent_attention_paged_einsum(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, pages: PagedLatents,
                                  scale: float) -> torch.Tensor:
    """The twin: gather the rows' pages, then latent_attention_einsum under their [B, 1, T, S] mask."""
    latent, k_rope, mask = gather_pages(pages, q_latent_BHTR.shape[2])
    return latent_attention_einsum(q_latent_BHTR, q_rope_BTHE, latent, k_rope, mask, 0, scale)


def latent_attention_paged_triton_eager(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor,
                                        latent_NPR: torch.Tensor, k_rope_NPE: torch.Tensor, table_BP: torch.Tensor,
                                        positions_B: torch.Tensor, scale: float, block_s: int | None = None, splits: int | None = None,
                                        num_warps: int | None = None) -> torch.Tensor:
    """The kernel over the pool itself: no gathered copy, and each row visits only the blocks up to its own
    position (a table padded to the longest context costs its padding nothing but empty programs)."""
    batch, heads, length, rank = q_latent_BHTR.shape
    rope = k_rope_NPE.shape[-1]
    if q_rope_BTHE.shape != (batch, length, heads, rope) or latent_NPR.shape[2] != rank \
            or k_rope_NPE.shape[:2] != latent_NPR.shape[:2] or table_BP.shape[0] != batch \
            or positions_B.shape != (batch,):
        raise ValueError(f"shapes: q_latent [B, H, T, R] {tuple(q_latent_BHTR.shape)}, q_rope [B, T, H, E] "
                         f"{tuple(q_rope_BTHE.shape)}, latent pool [N, page, R] {tuple(latent_NPR.shape)}, k_rope "
                         f"pool [N, page, E] {tuple(k_rope_NPE.shape)}, table [B, P] {tuple(table_BP.shape)}, "
                         f"positions [B] {tuple(positions_B.shape)} do not agree")
    if latent_NPR.dtype != q_latent_BHTR.dtype:  # casting would copy the whole pool
        raise ValueError(f"the pool holds {latent_NPR.dtype} but the query is {q_latent_BHTR.dtype}")
    total = table_BP.shape[1] * latent_NPR.shape[1]
    limits = positions_B.to(torch.int32) + 1  # slot s visible to query t while s < position + 1 + t
    return _launch(q_latent_BHTR, q_rope_BTHE.to(q_latent_BHTR.dtype), latent_NPR, k_rope_NPE, total, None,
                   ALL_VISIBLE, scale, block_s, splits, num_warps, table_BP, limits)


@torch.library.custom_op("k3::mla_decode_paged_triton", mutates_args=())
def mla_decode_paged_triton_op(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, latent_NPR: torch.Tensor,
                               k_rope_NPE: torch.Tensor, table_BP: torch.Tensor, positions_B: torch.Tensor,
                               scale: float) -> torch.Tensor:
    return latent_attention_paged_triton_eager(q_latent_BHTR, q_rope_BTHE, latent_NPR, k_rope_NPE, table_BP,
                                               positions_B, scale)


@mla_decode_paged_triton_op.register_fake
def _(q_latent_BHTR, q_rope_BTHE, latent_NPR, k_rope_NPE, table_BP, positions_B, scale):
    return q_latent_BHTR.new_empty(q_latent_BHTR.shape)


def latent_attention_paged_triton(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, pages: PagedLatents,
                                  scale: float) -> torch.Tensor:
    if torch.compiler.is_compiling():  # one opaque op in the graph, as latent_attention_triton
        return mla_decode_paged_triton_op(q_latent_BHTR, q_rope_BTHE, *pages, scale)
    return latent_attention_paged_triton_eager(q_latent_BHTR, q_rope_BTHE, *pages, scale)


def latent_attention_paged(q_latent_BHTR: torch.Tensor, q_rope_BTHE: torch.Tensor, pages: PagedLatents,
                           scale: float) -> torch.Tensor:
    """out_latent [B, H, T, R] over the engine's pool through the backend K3_MLA_DECODE picks (default
    auto): the kernel reads the pages in place, the twin gathers them first."""
    args = (q_latent_BHTR, q_rope_BTHE, pages, scale)
    backend = decode_backend()
    if backend == "triton":
        return latent_attention_paged_triton(*args)
    if backend == "auto" and pages.latent_NPR.dtype == q_latent_BHTR.dtype \
            and triton_pays(q_latent_BHTR, pages.latent_NPR, None, q_rope_BTHE, pages.k_rope_NPE):
        variant = ("mla_decode_paged_triton", q_latent_BHTR.shape[1], q_latent_BHTR.shape[3],
                   pages.k_rope_NPE.shape[2], pages.latent_NPR.shape[1], q_latent_BHTR.dtype)
        return with_torch_fallback(variant, lambda: latent_attention_paged_triton(*args),
                                   lambda: latent_attention_paged_einsum(*args))
    return latent_attention_paged_einsum(*args)
