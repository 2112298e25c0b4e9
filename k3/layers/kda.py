"""Kimi Delta Attention layer: projections, short convs, decay gate, beta, gated RMSNorm output.

Per head the state S [dk, dv] follows  S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,
o_t = S_t^T q_t; the recurrence itself lives in k3.ops.kda (chunked for prefill, recurrent for decode).
Decoding needs only S and the last (kernel-1) inputs of each short conv, whatever the context length.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from k3.cache import KDASlot, StateSnapshot
from k3.config import ModelConfig
from k3.layers.conv import ShortConv
from k3.layers.norm import GatedRMSNorm
from k3.layers.fused_weights import Group, fused, linear_group
from k3.ops.conv_step_triton import short_conv_step_inplace
from k3.ops.linear_triton import project
from k3.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_inplace, training_options
from k3.ops.short_conv import short_conv, short_conv_parts

# A padded token's beta and decay-gate logit: sigmoid and softplus of it are 0 in fp32 and bf16 (no write, no decay).
PAD_LOGIT = -1e4
# Up to this many new tokens with a cache, the step-by-step recurrence is cheaper than chunking.
RECURRENT_MAX_TOKENS = 16
# Longer inputs run the six input projections as one GEMM over weights concatenated on the fly (names and
# checkpoint layout unchanged). The concatenation copies the weights once per forward, which is noise next to
# a GEMM over many tokens; the backward then runs one dgrad GEMM instead of six and five adds. Decode steps
# keep the separate GEMMs (a per-step weight copy would triple the bytes a memory-bound step reads) unless the
# weights were fused into one buffer at load (k3.layers.fused_weights; the engine does so for its frozen copy).
FUSED_PROJECTION_MIN_TOKENS = RECURRENT_MAX_TOKENS + 1


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        d, h, dk = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.num_heads, self.head_dim = h, dk
        width = h * dk
        self.q_proj = nn.Linear(d, width, bias=False)
        self.k_proj = nn.Linear(d, width, bias=False)
        self.v_proj = nn.Linear(d, width, bias=False)
        self.q_conv1d = ShortConv(width, config.kda_conv_kernel)
        self.k_conv1d = ShortConv(width, config.kda_conv_kernel)
        self.v_conv1d = ShortConv(width, config.kda_conv_kernel)
        # Decay gate: low-rank f_b(f_a(x)) per channel, plus per-channel dt_bias and per-head A_log.
        self.f_a_proj = nn.Linear(d, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(config.kda_a_log_size or h))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.lower_bound = config.gate_lower_bound if config.kda_gate == "lower_bound" else None
        self.b_proj = nn.Linear(d, h, bias=False)
        if config.kda_output_gate == "full_rank":
            self.g_proj = nn.Linear(d, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, width, bias=False)
        self.o_norm = GatedRMSNorm(dk, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, d, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """Decay rates start spread log-uniformly in [1e-3, 1e-1] per step (as Mamba/fla initialise dt)."""
        h = self.num_heads
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        rate = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        if self.lower_bound is None:
            # softplus(dt_bias) * exp(A_log) = rate  ->  dt_bias = inverse_softplus(rate / exp(A_log))
            a = self.A_log[:h].exp().repeat_interleave(self.head_dim)
            target = (rate / a).clamp_min(1e-6)
            self.dt_bias.copy_(target + torch.log(-torch.expm1(-target)))
        else:
            # lb * sigmoid(exp(A_log) * dt_bias) = -rate  ->  dt_bias = logit(rate / |lb|) / exp(A_log)
            a = self.A_log[:h].exp().repeat_interleave(self.head_dim)
            p = (rate / abs(self.lower_bound)).clamp(1e-6, 1 - 1e-6)
            self.dt_bias.copy_(torch.log(p / (1 - p)) / a)

    def gate_kwargs(self) -> dict:
        """fla's in-kernel gate and beta options for this layer (A_log sliced to one entry per head).
        The bounded K3 gate takes fla's safe-gate path (bounded decays allow its faster M=16 tensor-core
        sub-chunks); fla accepts it only for lower bounds in [-5, 0)."""
        kwargs = dict(use_gate_in_kernel=True, A_log=self.A_log[: self.num_heads], dt_bias=self.dt_bias,
                      use_beta_sigmoid_in_kernel=True)
        if self.lower_bound is not None:
            kwargs.update(lower_bound=self.lower_bound, safe_gate=-5.0 <= self.lower_bound < 0.0)
        return kwargs

    def forward(self, x: torch.Tensor, cache: KDASlot | None = None, cu_seqlens: torch.Tensor | None = None,
                position_in_doc: torch.Tensor | None = None, max_documents: int | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. `cache` is this layer's slot (k3.cache.KDASlot, or None). Packed documents are
        given by cu_seqlens [N+1] (B must be 1) together with position_in_doc [T]; with max_documents, cu_seqlens
        is padded to max_documents + 1 entries by zero-length documents (static shapes: fla's graph mode, the
        convs by position alone)."""
        packed_kwargs = {}
        if max_documents is not None and cu_seqlens is not None:
            packed_kwargs = {"use_graph": True, "max_num_seqs": max_documents}
        batch, length, _ = x.shape
        shape = (batch, length, self.num_heads, self.head_dim)
        qkv, f_a, g_in, beta_logits = self._project(x)
        recurrent = cache is not None and length <= RECURRENT_MAX_TOKENS
        snapshot = cache.snapshot if cache is not None else None
        in_place = recurrent and cache.in_place and snapshot is None
        if (in_place and length == 1 and cu_seqlens is None and position_in_doc is None
                and not isinstance(qkv, (list, tuple))):
            # One decode token through the joined conv: one kernel reads the window where the cache keeps it,
            # slides it there and writes q, k, v contiguous (k3/ops/conv_step_triton.py).
            window, rows = cache.conv_window_in_place()
            q, k, v = short_conv_step_inplace(qkv, self._joined_conv_weight(), window, rows, parts=3).unbind(0)
            new_tails = None
        else:
            if cache is None:
                tails = (None, None, None)
            elif not isinstance(qkv, (list, tuple)) and (window := cache.conv_window) is not None:
                tails = window  # joined q/k/v tails in the joined conv's layout (read once: the pool's is a gather)
            else:
                tails = cache.conv_tails
            conv_cu = None if packed_kwargs else cu_seqlens  # static shapes: documents by position only
            (q, k, v), new_tails = self._convolve(qkv, tails, position_in_doc, conv_cu, planar=in_place)
        # The decay gate, beta's sigmoid and the q/k L2 norm run inside the KDA op (fused into fla's kernels on
        # CUDA; the PyTorch twin applies the same formulas), so only the raw projections are formed here.
        raw_gate = project(self.f_b_proj, f_a).view(shape)
        valid = cache.valid_lengths if cache is not None else None
        if valid is not None:
            # A right-padded prefill row: its padding must not move the state (beta 0 writes nothing, a zero
            # log-decay keeps everything), and its conv tails are the inputs before its own end.
            raw_gate, beta_logits = held_still(raw_gate, beta_logits,
                                               torch.arange(length, device=x.device) >= valid[:, None])
            if new_tails is not None:
                new_tails = tails_before(tails, qkv, new_tails, valid)
        if in_place:
            # The engine's pool and the static cache hold the states at fixed places: the kernel advances them
            # there, with no gathered copy going in and no new state to copy back.
            state_pool, state_indices = cache.state_in_place()
            o = fused_recurrent_kda_inplace(q.view(shape), k.view(shape), v.view(shape), raw_gate, beta_logits,
                                            state_pool, state_indices, use_qk_l2norm_in_kernel=True,
                                            **self.gate_kwargs())
            if new_tails is not None:
                cache.update_conv_tails(new_tails)
        elif snapshot is not None:
            options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, **self.gate_kwargs())
            first = functools.partial(fused_recurrent_kda if recurrent else chunk_kda, **options)
            rest = functools.partial(fused_recurrent_kda if snapshot.width <= RECURRENT_MAX_TOKENS else chunk_kda,
                                     **options)
            rows = valid if valid is not None else torch.full((batch,), length, device=x.device)
            o, saved, new_state = kda_with_snapshot((first, rest), q.view(shape), k.view(shape), v.view(shape),
                                                    raw_gate, beta_logits, cache.state, rows, snapshot)
            cache.save_snapshot(saved, tails_before(tails, qkv, new_tails, snapshot.at))
            cache.update(new_state, new_tails)
        else:
            state = cache.state if cache is not None else None
            kernel = fused_recurrent_kda if recurrent else chunk_kda
            trained = training_options() if kernel is chunk_kda and torch.is_grad_enabled() else {}
            o, new_state = kernel(q.view(shape), k.view(shape), v.view(shape), raw_gate, beta_logits,
                                  initial_state=state, output_final_state=cache is not None,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **self.gate_kwargs(),
                                  **packed_kwargs, **trained)
            if cache is not None:
                cache.update(new_state, new_tails)
        gate = g_in if hasattr(self, "g_proj") else project(self.g_b_proj, g_in)
        o = self.o_norm(o.to(x.dtype), gate.view(shape))
        return project(self.o_proj, o.reshape(batch, length, -1))

    def _input_projections(self) -> list[nn.Linear]:
        """Every projection that reads the layer input x, in the order _project returns them."""
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj]

    def _project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[q, k, v] (before the convs; one [B, T, 3 * width] tensor when the GEMM was one), f_a(x), the
        output gate's first projection, beta logits."""
        projections = self._input_projections()
        group = fused(self, "input")  # weights fused at load (k3.layers.fused_weights): one GEMM at any length
        if group is not None:
            # q, k and v side by side, as the joined conv and a decode cache's joined tail window take them.
            return linear_group(x, group, join_first=3)
        if x.shape[1] < FUSED_PROJECTION_MIN_TOKENS:
            outputs = [p(x) for p in projections]
        else:
            weight = torch.cat([p.weight for p in projections], dim=0)
            width = self.q_proj.out_features
            sizes = [3 * width] + [p.out_features for p in projections[3:]]
            return list(torch.nn.functional.linear(x, weight).split(sizes, dim=-1))
        return [outputs[:3], *outputs[3:]]

    def short_convs(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def fusable_groups(self) -> list[Group]:
        """The input projections as one GEMM, the q/k/v conv weights as one buffer (k3.layers.fused_weights)."""
        return [("kda", "input", [(p, "weight") for p in self._input_projections()], 0),
                ("kda_conv", "conv", [(c, "weight") for c in self.short_convs()], 0)]

    def _joined_conv_weight(self) -> torch.Tensor:
        """The q, k and v conv weights side by side, [3 * width, W]."""
        group = fused(self, "conv")  # the three weights in one buffer (k3.layers.fused_weights)
        convs = self.short_convs()
        return (group.buffer if group is not None else torch.cat([c.weight for c in convs], dim=0)).squeeze(1)

    def _convolve(self, qkv, tails, position_in_doc, cu_seqlens, planar: bool = False):
        """The short convs of q, k and v -> ([q, k, v], their new tails). A depthwise conv treats channels
        independently, so when q, k, v arrive as one [B, T, 3 * width] block (long inputs) the three convs run
        as one call over their channels side by side (weights and tails concatenated on the fly, a few KB):
        one kernel launch and one autograd node instead of three, which the host-bound training step feels.
        `tails` is a tuple of three (or of Nones), or one joined [B, W-1, 3 * width] window (a decode cache's
        layout); a joined window comes back joined, for the cache to store with one copy.

        planar: a joined output comes back as three contiguous tensors (one [3, B, T, width] block) rather than
        three column slices, for fla's in-place decode kernel, which takes its inputs contiguous: one copy where
        its launcher made three (an uncompiled batch-64 graph of `small` went from 784 to 760 kernels on one
        H200; compiled, Inductor still writes q, k and v one kernel each, as it did the slices' copies). Where
        k3's Triton conv runs (training, prefill from empty: k3.ops.short_conv.short_conv_parts) the three come
        contiguous from the kernel itself, planar or not, and their gradients go back without a cat."""
        convs = self.short_convs()
        joined = isinstance(tails, torch.Tensor)
        if isinstance(qkv, (list, tuple)):
            if joined:
                tails = tails.chunk(3, dim=-1)
            pairs = [conv(t, tail, position_in_doc, cu_seqlens) for conv, t, tail in zip(convs, qkv, tails)]
            return [y for y, _ in pairs], tuple(tail for _, tail in pairs)
        width = qkv.shape[-1] // 3
        weight_CW = self._joined_conv_weight()
        tail = tails if joined else None if tails[0] is None else torch.cat(tails, dim=-1)
        parts, new_tail = short_conv_parts(qkv, weight_CW, 3, tail, cu_seqlens=cu_seqlens,
                                           position_in_doc=position_in_doc, planar=planar, conv=short_conv)
        return parts, new_tail if joined else tuple(new_tail.split(width, dim=-1))


def held_still(gate_logits: torch.Tensor, beta_logits: torch.Tensor, where_BT: torch.Tensor):
    """(gate logits [B, T, H, K], beta logits [B, T, H]) with the tokens where where_BT holds made no-ops: beta 0
    writes nothing and a zero log-decay keeps everything (PAD_LOGIT), so the state passes them unchanged."""
    return (gate_logits.masked_fill(where_BT[:, :, None, None], PAD_LOGIT),
            beta_logits.masked_fill(where_BT[:, :, None], PAD_LOGIT))


def kda_with_snapshot(kernels, q, k, v, gate_logits, beta_logits, state, rows: torch.Tensor,
                      snapshot: StateSnapshot):
    """KDA over [B, T] in two calls that split each row at snapshot.at[b] (its first tokens, then the rest moved
    to the front), so the state there can be kept: (o [B, T, H, V], the states at `at`, the final states). rows
    [B]: each row's real tokens (right padding beyond). Masked positions (PAD_LOGIT: beta 0 writes nothing, a
    zero log-decay keeps everything) leave a state as it was, as in a padded prefill. kernels: for the first
    tokens and for the rest, chunk_kda or fused_recurrent_kda (a short rest) with their options bound, each
    returning (o, final state)."""
    first, rest_kernel = kernels
    batch, length = q.shape[:2]
    at = snapshot.at
    later_BT = torch.arange(length, device=q.device) >= at[:, None]
    o_first, saved = first(q, k, v, *held_still(gate_logits, beta_logits, later_BT), initial_state=state)
    # The rest of each row, from `at` on, at the front of width columns; columns past the row's end point at a
    # dummy position `length` (one zero column appended), where the outputs' scatter drops what they computed.
    index_BJ = at[:, None] + torch.arange(snapshot.width, device=q.device)
    real_BJ = index_BJ < rows[:, None]
    index_BJ = torch.where(real_BJ, index_BJ, length)

    def rest(t):
        t = torch.cat([t, t.new_zeros(batch, 1, *t.shape[2:])], dim=1)
        return t.gather(1, index_BJ.view(batch, -1, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))

    o_rest, final = rest_kernel(rest(q), rest(k), rest(v), *held_still(rest(gate_logits), rest(beta_logits), ~real_BJ),
                                initial_state=saved)
    o = torch.cat([o_first, o_first.new_zeros(batch, 1, *o_first.shape[2:])], dim=1)
    o = o.scatter(1, index_BJ.view(batch, -1, 1, 1).expand(-1, -1, *o.shape[2:]), o_rest.to(o.dtype))
    return o[:, :length], saved, final


def tails_before(tails, qkv, new_tails, valid: torch.Tensor):
    """The conv tails of right-padded rows: row b's W-1 inputs before its own end valid[b] (reaching into its
    previous tail where it has fewer new tokens), in new_tails' layout. tails: the previous tails as _convolve took
    them (a joined [B, W-1, 3C] window, or three tensors or Nones); qkv: the conv inputs (joined [B, T, 3C] or
    three [B, T, C])."""
    def one(previous, inputs, like):
        if previous is None:
            previous = inputs.new_zeros(like.shape)
        source = torch.cat([previous.to(inputs.dtype), inputs], dim=1)  # [B, W-1+T, C]
        index = valid[:, None] + torch.arange(like.shape[1], device=valid.device)  # [B, W-1]
        return source.gather(1, index[:, :, None].expand(-1, -1, source.shape[-1])).to(like.dtype)

    if isinstance(new_tails, torch.Tensor):  # joined window back
        previous = tails if isinstance(tails, torch.Tensor) else None if tails[0] is None else torch.cat(tails, -1)
        inputs = qkv if isinstance(qkv, torch.Tensor) else torch.cat(list(qkv), dim=-1)
        return one(previous, inputs, new_tails)
    if isinstance(tails, torch.Tensor):
        tails = tails.chunk(3, dim=-1)
    inputs = qkv.chunk(3, dim=-1) if isinstance(qkv, torch.Tensor) else qkv
    return tuple(one(p, x, like) for p, x, like in zip(tails, inputs, new_tails))
