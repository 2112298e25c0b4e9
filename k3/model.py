"""The K3 causal language model: a hybrid stack of KDA and Gated-MLA layers with dense/MoE feed-forwards,
joined by block Attention Residuals (or plain residuals when attn_res_block_size is 0).

Single-device code only: caches, parallelism and quantisation wrap it from outside.
Parameter names follow the published K3 checkpoint layout (model.layers.{i}.self_attn..., see SPEC §12).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3.cache import HybridCache
from k3.config import ModelConfig
from k3.layers.attn_res import AttnResMix, AttnResStream
from k3.layers.conv import ShortConv
from k3.layers.kda import KimiDeltaAttention
from k3.layers.mla import GatedMLA
from k3.layers.mlp import GLUMLP
from k3.layers.moe import LatentMoE, Router
from k3.layers.norm import RMSNorm
from k3.ops.linear_ce import linear_cross_entropy


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, V]; None when only the loss was asked for (return_logits=False)
    loss: torch.Tensor | None = None


@dataclass
class PackedDocs:
    """Where packed documents start, in the forms the layers want."""

    cu_seqlens: torch.Tensor  # [N+1] int, starts of documents plus the total length
    position_in_doc: torch.Tensor  # [T]
    # Static-shape form (a CUDA-graph step): cu_seqlens padded with zero-length documents to max_documents + 1
    # entries, nothing read back to the host; documents never cross a row of row_length tokens.
    max_documents: int | None = None
    row_length: int | None = None

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, length: int) -> "PackedDocs":
        cu = cu_seqlens.to(torch.long)
        if cu[0] != 0 or cu[-1] != length or (cu[1:] < cu[:-1]).any():
            raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {length}, got {cu.tolist()}")
        positions = torch.arange(length, device=cu.device)
        doc_ids = torch.searchsorted(cu[1:], positions, right=True)
        return cls(cu, positions - cu[doc_ids])

    @classmethod
    def padded(cls, cu_seqlens: torch.Tensor, length: int, max_documents: int,
               row_length: int | None = None) -> "PackedDocs":
        """The static form from cu_seqlens already padded to max_documents + 1 entries (pad_cu_seqlens). Only
        shapes are checked (on the host, no sync): the values are the caller's."""
        if cu_seqlens.shape != (max_documents + 1,):
            raise ValueError(f"padded cu_seqlens must have max_documents + 1 = {max_documents + 1} entries, got "
                             f"shape {tuple(cu_seqlens.shape)} (pad with pad_cu_seqlens)")
        if row_length is not None and length % row_length:
            raise ValueError(f"{length} packed tokens do not split into rows of {row_length}")
        cu = cu_seqlens.to(torch.long)
        positions = torch.arange(length, device=cu.device)
        # right=True over the padded ends: a position equal to a start belongs to the document that starts there
        doc_ids = torch.searchsorted(cu[1:], positions, right=True)
        return cls(cu, positions - cu[doc_ids], max_documents, row_length)


def pad_cu_seqlens(cu_seqlens: torch.Tensor, max_documents: int) -> torch.Tensor:
    """cu_seqlens [N+1] -> [max_documents + 1], the total repeated (zero-length documents): a static shape for
    a captured step. Raises when N > max_documents."""
    documents = cu_seqlens.numel() - 1
    if documents > max_documents:
        raise ValueError(f"{documents} documents exceed max_documents={max_documents}")
    pad = cu_seqlens[-1:].expand(max_documents - documents)
    return torch.cat([cu_seqlens.to(torch.long), pad.to(torch.long)])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.attention_type = config.layer_types[index]
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = (GatedMLA(config, index) if self.attention_type == "mla"
                          else KimiDeltaAttention(config, index))
        if config.is_moe_layer(index):
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = GLUMLP(config, d, config.intermediate_size)
        self.attn_res = config.attn_res_block_size > 0
        if self.attn_res:
            self.self_attention_res = AttnResMix(d, config.rms_norm_eps)
            self.mlp_res = AttnResMix(d, config.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def attend(self, x: torch.Tensor, cache, packed: PackedDocs | None) -> torch.Tensor:
        if self.attention_type == "mla":
            if packed is None:
                return self.self_attn(x, cache)
            if packed.max_documents is not None:
                return self.self_attn(x, cache, cu_seqlens=packed.cu_seqlens, position_in_doc=packed.position_in_doc,
                                      row_length=packed.row_length)
            return self.self_attn(x, cache, cu_seqlens=packed.cu_seqlens)
        if packed is None:
            return self.self_attn(x, cache)
        return self.self_attn(x, cache, cu_seqlens=packed.cu_seqlens, position_in_doc=packed.position_in_doc,
                              max_documents=packed.max_documents)

    def forward(self, h: torch.Tensor, cache=None, packed: PackedDocs | None = None) -> torch.Tensor:
        """Plain pre-norm residual form."""
        h = h + self.attend(self.input_layernorm(h), cache, packed)
        return h + self.feed_forward(self.post_attention_layernorm(h))

    def forward_attn_res(self, stream: AttnResStream, cache=None, packed: PackedDocs | None = None) -> None:
        """Block-AttnRes form: both sublayers read a softmax mixture of the stream's sources."""
        stream.start_layer(self.index)
        x = self.self_attention_res(stream.sources(), stream.finished)
        stream.add(self.attend(self.input_layernorm(x), cache, packed))
        x = self.mlp_res(stream.sources(), stream.finished)
        stream.add(self.feed_forward(self.post_attention_layernorm(x)))


class K3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size > 0:
            self.output_attn_res = AttnResMix(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, cache: HybridCache | None = None,
                packed: PackedDocs | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.config.attn_res_block_size > 0:
            stream = AttnResStream(h, self.config.attn_res_block_size)
            for i, layer in enumerate(self.layers):
                layer.forward_attn_res(stream, cache[i] if cache is not None else None, packed)
            h = self.output_attn_res(stream.sources(), stream.finished)
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, cache[i] if cache is not None else None, packed)
        return self.norm(h)


@torch.no_grad()
def init_module(module: nn.Module, std: float) -> None:
    """Initialise the tensors `module` holds itself (not its children's)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, Router):
        nn.init.normal_(module.weight, std=std)
        module.e_score_correction_bias.zero_()
    elif isinstance(module, LatentMoE):
        for w in (module.w1, module.w3, module.w2):
            nn.init.normal_(w, std=std)
    elif isinstance(module, KimiDeltaAttention):
        module.reset_gate_parameters()
    elif isinstance(module, ShortConv):
        module.reset_parameters()  # nn.Conv1d's own init


@torch.no_grad()
def zero_attn_res_queries(model: nn.Module) -> None:
    """Pseudo-queries start at zero: the first mixtures are uniform means."""
    for module in model.modules():
        if isinstance(module, AttnResMix):
            module.proj.weight.zero_()


class K3ForCausalLM(nn.Module):
    """model(input_ids [B, T], cache=None, cu_seqlens=None, labels=None) -> CausalLMOutput(logits [B, T, V]).
    inputs_embeds [B, T, d] may stand in for input_ids (the multimodal wrapper's image embeddings enter so).
    With labels and return_logits=False only the loss is formed (k3.ops.linear_ce; logits is None).
    Packed documents: input_ids [1, total] with cu_seqlens [N+1]; or, with static shapes for a captured step,
    cu_seqlens padded to max_documents + 1 entries (pad_cu_seqlens) and row_length, the rows that documents never
    cross (full attention then masks within each row instead of looping over documents on the host)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Write every parameter and buffer from the global RNG (a model built on the meta device and moved with
        `to_empty` holds garbage until this runs). k3.distributed.init.init_weights_seeded is the
        layout-independent form for sharded models."""
        for module in self.modules():
            init_module(module, self.config.initializer_range)
        zero_attn_res_queries(self)

    def new_cache(self, batch_size: int) -> HybridCache:
        return HybridCache(self.config.layer_types, batch_size)

    def forward(self, input_ids: torch.Tensor | None, cache: HybridCache | None = None,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, return_logits: bool = True,
                max_documents: int | None = None, row_length: int | None = None) -> CausalLMOutput:
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"inputs_embeds must be [batch, length, {self.config.hidden_size}], got shape "
                                 f"{tuple(inputs_embeds.shape)}")
            tokens = inputs_embeds
        else:
            tokens = input_ids
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
            # On a GPU this check would read the ids back to the host on every forward (a sync that stalls the
            # launch queue and breaks CUDA-graph capture); there the embedding kernel's own bounds assert stands in.
            if input_ids.device.type == "cpu" and (int(input_ids.max()) >= self.config.vocab_size
                                                   or int(input_ids.min()) < 0):
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got range "
                                 f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        packed = None
        if cu_seqlens is not None:
            if tokens.shape[0] != 1 or cache is not None:
                raise ValueError("packed input (cu_seqlens) takes input_ids of shape [1, total] and no cache")
            if max_documents is not None:  # static shapes, no host sync: what a captured training step runs
                packed = PackedDocs.padded(cu_seqlens.to(tokens.device), tokens.shape[1], max_documents, row_length)
            else:
                packed = PackedDocs.from_cu_seqlens(cu_seqlens.to(tokens.device), tokens.shape[1])
        if cache is not None and cache.batch_size != tokens.shape[0]:
            raise ValueError(f"cache was made for batch {cache.batch_size} but input has batch {tokens.shape[0]}")
        hidden = self.model(input_ids, cache, packed, inputs_embeds)
        if cache is not None:
            cache.seen_tokens += tokens.shape[1]
        if labels is not None and not return_logits:
            # The loss alone: the LM head and cross-entropy as one op (k3.ops.linear_ce, K3_LINEAR_CE picks the
            # path), which need not hold [tokens, vocab] logits.
            return CausalLMOutput(logits=None, loss=linear_cross_entropy(hidden, self.lm_head, labels))
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss)

    # --- balancing ------------------------------------------------------------------------------
    def routers(self) -> list[tuple[int, Router]]:
        return [(i, layer.block_sparse_moe.gate) for i, layer in enumerate(self.model.layers)
                if hasattr(layer, "block_sparse_moe")]

    @torch.no_grad()
    def update_balancers(self, all_reduce=None) -> None:
        """One bias update per MoE layer from the statistics of the forwards since the last call."""
        for _, router in self.routers():
            router.update_bias(all_reduce)

    def moe_maxvio(self) -> dict[int, float]:
        """maxvio of the last forward, per MoE layer index."""
        return {i: v for i, r in self.routers() if (v := r.maxvio()) is not None}


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Total and active parameters, counted on the meta device (nothing is allocated).
    Active excludes the input embedding and all but top-k of the routed experts; it includes the LM head."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(m.w1.numel() + m.w2.numel() + m.w3.numel() for m in model.modules() if isinstance(m, LatentMoE))
    embedding = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    inactive = routed * (1 - config.num_experts_per_tok / config.num_experts) if routed else 0
    return {"total_params": total, "active_params": int(round(total - embedding - inactive)),
            "embedding_params": model.model.embed_tokens.weight.numel(), "routed_expert_params": routed}
