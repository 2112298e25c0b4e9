"""Block Attention Residuals (AttnRes).

Instead of h_l = h_{l-1} + f(h_{l-1}), a sublayer's input is a softmax mixture over depth:

    h = sum_i alpha_i v_i,   alpha = softmax_i( w . RMSNorm(v_i) )

with w a learned pseudo-query (zero-initialised, so the mixture starts as the uniform mean) and RMSNorm
carrying a learned gain. The score of a source is therefore (v . (norm_w * w)) / rms(v). Everything is
computed in fp32 and cast back.

Block form (K3: block size 12): sources are b_0 = the token embedding, the finished block sums b_1..b_{n-1},
and the current block's partial sum. `AttnResStream` keeps that bookkeeping for the model.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.layers.norm import RMSNorm
from k3.ops.attn_res import attn_res_mix
from k3.ops.attn_res_triton import FinishedSources


class AttnResMix(nn.Module):
    """One mixing point: a pseudo-query `proj` (Linear d -> 1, zero-init) and a key norm `norm`."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.norm = RMSNorm(dim, eps)

    def forward(self, sources: list[torch.Tensor], finished: FinishedSources | None = None) -> torch.Tensor:
        """sources: list of S tensors [B, T, D]. Returns the mixture [B, T, D] in the sources' dtype.
        `finished`: the stream's registered sources (their gradients summed in place by the Triton backward)."""
        if len(sources) == 1:
            return sources[0]
        # Eager on CPU, Triton kernels on CUDA (k3.ops.attn_res; K3_ATTN_RES_BACKEND picks one).
        return attn_res_mix(sources, self.norm.weight, self.proj.weight.squeeze(0), self.norm.eps, finished)


class AttnResStream:
    """Depth bookkeeping for block AttnRes over one forward pass.

    `blocks` holds b_0 (embedding) and each finished block sum; `partial` is the running sum of sublayer
    outputs in the current block (None right after a block closes). `finished` registers the blocks for mixes
    that sum their gradients in place (k3.ops.attn_res_triton.FinishedSources); None under torch.compile, which
    traces the eager mix."""

    def __init__(self, embedding: torch.Tensor, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding
        self.finished = None if torch.compiler.is_compiling() else FinishedSources()

    def sources(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def start_layer(self, layer_index: int) -> None:
        """At a block boundary the running sum becomes a finished source (the embedding counts as b_0)."""
        if layer_index % self.block_size == 0:
            assert self.partial is not None
            self.blocks.append(self.partial)
            if self.finished is not None:
                self.finished.add(self.partial)
            self.partial = None

    def add(self, output: torch.Tensor) -> None:
        self.partial = output if self.partial is None else self.partial + output
