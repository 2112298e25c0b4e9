"""Gated Multi-head Latent Attention (DeepSeek-style MLA, NoPE, with K3's sigmoid output gate).

Keys and values come from a shared latent c = RMSNorm(W_dkv x) of width kv_lora_rank, plus one shared
"rope" key part of width qk_rope_head_dim that is used without rotation (K3 has no positional encoding).

Two equal computations:
- expanded (prefill/training): k_nope, v = W_ukv c, then scaled-dot-product attention per head;
- absorbed (decode): W_uk is folded into the query and W_uv into the output, so attention runs directly
  against the cached latent and the cache holds only kv_lora_rank + qk_rope_head_dim numbers per token.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3.cache import MLASlot
from k3.config import ModelConfig
from k3.layers.fused_weights import Group, fused, linear_group
from k3.layers.norm import RMSNorm
from k3.ops.linear_triton import project
from k3.ops.shared_input_linear import joins_projections, linears_of_one_input
from k3.ops.mla_decode import latent_attention, latent_attention_paged
from k3.ops.packed_attention import (packed_attention_backend, packed_attention_varlen,
                                     packed_causal_attention)

# Packed documents (and the engine's prefills: every prompt a new length) give attention a new shape at nearly
# every call, and cuDNN's SDPA builds an execution plan for each new shape: in `k3 train --preset small` on one
# H200 (packed 2048-token rows, `k3 train --profile`) its forward and backward took 7.3 and 8.1 ms of host time
# per call, 736 ms of a 1,364 ms step whose kernels took 296. Flash and memory-efficient attention build nothing
# per shape.
PER_DOCUMENT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# With a cache, up to this many new tokens attend in latent space (absorbed); longer inputs use expanded SDPA.
ABSORB_MAX_TOKENS = 16


class GatedMLA(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        d, h = config.hidden_size, config.mla_num_heads
        self.num_heads = h
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        latent_eps = config.rms_norm_eps if config.mla_latent_norm_eps is None else config.mla_latent_norm_eps
        self.scaling = (self.nope + self.rope) ** -0.5
        q_out = h * (self.nope + self.rope)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, h * self.v_dim, bias=False) if config.mla_output_gate else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        # Decode against the latent cache (absorbed) unless told otherwise; tests flip this to compare.
        self.absorb_in_decode = True

    def _input_projections(self) -> list[nn.Linear]:
        """The projections that read x: the query's first (q_a, or q without q_lora), kv_a, the output gate."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return [first, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.g_proj is not None else [])

    def fusable_groups(self) -> list[Group]:
        """The projections that read x as one GEMM (k3.layers.fused_weights)."""
        return [("mla", "input", [(p, "weight") for p in self._input_projections()], 0)]

    def _project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of _input_projections (one GEMM when their weights were fused at load)."""
        group = fused(self, "input")
        if group is not None:
            return linear_group(x, group)
        projections = self._input_projections()
        if joins_projections(x, projections):
            # Training: one GEMM, and one dgrad chain instead of autograd adding three dx (shared_input_linear).
            return linears_of_one_input(x, [p.weight for p in projections])
        return [p(x) for p in projections]

    def _query(self, q_first: torch.Tensor) -> torch.Tensor:
        q = q_first if self.q_lora_rank is None else project(self.q_b_proj, self.q_a_layernorm(q_first))
        return q.view(*q_first.shape[:2], self.num_heads, self.nope + self.rope)  # [B, T, H, nope+rope]

    def _latent(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(latent), k_rope  # [B, T, R], [B, T, rope]

    def forward(self, x: torch.Tensor, cache: MLASlot | None = None, cu_seqlens: torch.Tensor | None = None,
                position_in_doc: torch.Tensor | None = None, row_length: int | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. `cache` is this layer's slot (k3.cache.MLASlot, or None); packed documents are given by
        cu_seqlens [N+1] (no cache), and attention never crosses a document boundary. Static-shape form (a
        captured step): position_in_doc [T] as well, with rows of row_length tokens that no document crosses
        (None: one row) and cu_seqlens padded with zero-length documents (k3.model.pad_cu_seqlens) or None;
        attention is then one call over all rows (k3.ops.packed_attention), no host sync."""
        if position_in_doc is not None:
            return self._forward_static_documents(x, position_in_doc, row_length or x.shape[1], cu_seqlens)
        batch, length, _ = x.shape
        q_first, kv, *gate = self._project(x)
        q = self._query(q_first)
        latent, k_rope = self._latent(kv)
        past = 0
        visible = pages = limits = None
        absorb = cache is not None and self.absorb_in_decode
        if cache is not None and absorb and length <= ABSORB_MAX_TOKENS and cache.pages_in_place:
            # The engine's pool in decode: attention reads the rows' pages where they lie (no gathered copy).
            pages = cache.append_in_place(latent, k_rope)
        elif cache is not None:
            past = cache.length
            latent, k_rope = cache.append(latent, k_rope)
            # A preallocated (static) cache returns its whole buffer and a [T, capacity] mask of the filled
            # slots, computed on the device, so a decode step can be captured as a CUDA graph.
            visible, limits = cache.visible_mask, cache.visible_limits
        # Decode attends in latent space; a long prefill takes the expanded path, whose causal SDPA call runs a
        # flash kernel instead of materialising [H, T, T] scores.
        if pages is not None:
            out = self._attend_absorbed(q, pages=pages)
        elif absorb and (length <= ABSORB_MAX_TOKENS or visible is not None):
            out = self._attend_absorbed(q, latent, k_rope, past, visible, limits=limits)
        else:
            out = self._attend_expanded(q, latent, k_rope, past, cu_seqlens, shapes_vary=cache is not None)
        out = out.reshape(batch, length, self.num_heads * self.v_dim)
        if gate:
            out = out * torch.sigmoid(gate[0])
        return project(self.o_proj, out)

    def _forward_static_documents(self, x: torch.Tensor, position_in_doc: torch.Tensor, row_length: int,
                                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Packed documents [1, total] in rows of row_length tokens, each query seeing its own document's earlier
        tokens (k3.ops.packed_attention: a masked call over the rows, or flash varlen over cu_seqlens)."""
        batch, length, _ = x.shape
        if batch != 1 or length % row_length:
            raise ValueError(f"packed input is [1, total] with total a multiple of row_length={row_length}; got "
                             f"{tuple(x.shape[:2])}")
        q_first, kv, *gate = self._project(x)
        q = self._query(q_first)
        k, v = self._keys_values(*self._latent(kv))
        out = packed_causal_attention(q, k, v, position_in_doc, row_length, self.scaling, cu_seqlens)
        out = out.reshape(batch, length, self.num_heads * self.v_dim)
        if gate:
            out = out * torch.sigmoid(gate[0])
        return project(self.o_proj, out)

    def _keys_values(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, S, R], k_rope [B, S, rope] -> per-head keys [B, S, H, nope + rope] and values [B, S, H, v]."""
        batch, total = latent.shape[:2]
        kv = self.kv_b_proj(latent).view(batch, total, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.num_heads, -1)], dim=-1), v

    def _attend_expanded(self, q, latent, k_rope, past, cu_seqlens=None, shapes_vary: bool = False):
        """shapes_vary: an inference prefill, whose (rows, length) changes with every prompt: no cuDNN (a plan per
        new shape, see PER_DOCUMENT_BACKENDS), where training's fixed rows keep it."""
        batch, length = q.shape[:2]
        total = latent.shape[1]
        k, v = self._keys_values(latent, k_rope)
        if cu_seqlens is not None and past == 0:
            # Packed documents: one causal SDPA call per document. Exact, keeps the fast causal kernels, and
            # costs sum(len^2) instead of the (total)^2 of a block-diagonal mask over the whole pack.
            bounds = cu_seqlens.tolist()
            if batch == 1 and packed_attention_backend(q, k, v, cu_seqlens) == "varlen":
                longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
                return packed_attention_varlen(q, k, v, cu_seqlens, longest, self.scaling)  # [1, T, H, v]
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
            with sdpa_kernel(PER_DOCUMENT_BACKENDS):  # no cuDNN: a plan per new shape (see PER_DOCUMENT_BACKENDS)
                pieces = [F.scaled_dot_product_attention(qt[:, :, a:b], kt[:, :, a:b], vt[:, :, a:b],
                                                         is_causal=b - a > 1, scale=self.scaling)
                          for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            return torch.cat(pieces, dim=2).transpose(1, 2)  # [B, T, H, v]
        # After `past` cached tokens the causal diagonal sits bottom-right. causal_lower_right says so without
        # a [T, past + T] boolean mask (64 GB for a 64K chunk at 1M context) and keeps the flash kernels.
        mask = None
        if past > 0 and length > 1:
            from torch.nn.attention.bias import causal_lower_right  # here: importing it imports torch._dynamo (~1.5 s)

            mask = causal_lower_right(length, total)
        with sdpa_kernel(PER_DOCUMENT_BACKENDS) if shapes_vary else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                attn_mask=mask, is_causal=past == 0 and length > 1, scale=self.scaling)
        return out.transpose(1, 2)  # [B, T, H, v]

    def _attend_absorbed(self, q, latent=None, k_rope=None, past=0, mask=None, pages=None, limits=None):
        """Attention in latent space: score = (q_nope W_uk) . c + q_rope . k_rope; out = (p . c) W_uv. The
        cache is (latent, k_rope) gathered per row, or the pool's `pages` (PagedLatents)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, nope, R], [H, v, R]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_latent = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk.to(q.dtype))
        # K3_MLA_DECODE: a Triton flash-decode kernel for CUDA inference, else the einsum twin (k3.ops.mla_decode).
        if pages is not None:
            out_latent = latent_attention_paged(q_latent, q_rope, pages, self.scaling)
        else:
            out_latent = latent_attention(q_latent, q_rope, latent, k_rope, mask, past, self.scaling, limits)
        return torch.einsum("bhtr,hvr->bthv", out_latent, w_uv.to(q.dtype))
