"""Tensor-name maps between k3's native state dict and the published Hugging Face layouts.

Native names (k3/model.py) already follow the K3 release except for three things:
- AttnRes mixes are modules: `self_attention_res.proj.weight` / `.norm.weight` (published:
  `self_attention_res_proj.weight` / `self_attention_res_norm.weight`, older `self_attention_res.proj_weight`);
- routed experts are stacked: `block_sparse_moe.w1` [E, F, L] (gate), `w3` [E, F, L] (up), `w2` [E, L, F] (down)
  (published: one `experts.{e}.w1.weight` [F, L] ... per expert, MXFP4 `weight_packed`/`weight_scale` in K3);
- the K3 release wraps the text model: every name carries `language_model.`.

Kimi-Linear comes in two spellings, told apart per tensor name:
- Moonshot's release (also what transformers' save_pretrained writes back): `self_attn.q_conv1d.weight`,
  `self_attn.A_log` [1, 1, H, 1], `block_sparse_moe.experts.{e}.w1.weight`, dense layer `mlp.*`
  (transformers writes the dense layer as `block_sparse_moe.{gate,up,down}_proj`);
- transformers' in-memory layout: `self_attn.conv1d.weight` [3*H*dk, 1, K] (q, k, v stacked),
  `self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}`, `mlp.experts.gate_up_proj` [E, 2F, D],
  `mlp.experts.down_proj` [E, D, F], `mlp.gate.*`, `mlp.shared_experts.*`.

A checkpoint tensor becomes one or more `Piece`s: (native name, which part of the checkpoint tensor,
which part of the native tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3.config import ModelConfig

FORMATS = ("kimi_linear", "kimi_k3")
# The weight files of an HF directory: one file, or shards listed in an index.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
K3_PREFIX = "language_model."
# Parts of the K3 release a text-only model does not have.
K3_SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "model.mtp.", "multi_modal_projector.")
# Derived buffers some exporters write; never weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".weight_shape")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_ATTN_RES = re.compile(r"^(self_attention_res|mlp_res)(?:_(proj|norm)\.weight|\.(proj|norm)_weight)$")
_OUTPUT_ATTN_RES = re.compile(r"^model\.output_attn_res(?:_(proj|norm)\.weight|\.(proj|norm)_weight)$")
_MOE_SUBMODULES = ("gate.", "shared_experts.", "routed_expert_down_proj.", "routed_expert_norm.",
                   "routed_expert_up_proj.")
_DENSE_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor (or a part of it) landing in one native tensor (or a part of it).

    source: a slice of the checkpoint tensor along `source_dim` (None: all of it);
    expert: the index along dim 0 of a stacked native expert tensor (None: the whole native tensor);
    reshape: the checkpoint shape may differ from the native one with the same element count
    (A_log [1, 1, H, 1] vs [H], an AttnRes pseudo-query [d] vs [1, d]);
    mxfp4: the checkpoint tensor is `weight_packed`; its `weight_scale` sibling completes it."""

    target: str
    source: slice | None = None
    source_dim: int = 0
    expert: int | None = None
    reshape: bool = False
    mxfp4: bool = False


def strip_prefix(name: str, fmt: str) -> str | None:
    """The checkpoint name without its format prefix, or None when the tensor is not part of a text model."""
    if fmt == "kimi_k3":
        if name.startswith("model.language_model."):  # transformers' in-memory multimodal spelling
            name = "model." + name[len("model.language_model."):]
        elif name.startswith(K3_PREFIX):
            name = name[len(K3_PREFIX):]
    if name.startswith(K3_SKIPPED_PREFIXES) or name.endswith(IGNORED_SUFFIXES):
        return None
    return name


def checkpoint_to_native(name: str, config: ModelConfig, native_shapes: dict[str, tuple[int, ...]]) -> list[Piece]:
    """Map one (prefix-stripped) checkpoint tensor name to native pieces. [] means: not a tensor k3 knows."""
    if name in native_shapes:
        return [Piece(name, reshape=name.endswith("A_log"))]
    match = _OUTPUT_ATTN_RES.match(name)
    if match:
        part = match.group(1) or match.group(2)
        return [Piece(f"model.output_attn_res.{part}.weight", reshape=True)]
    match = _LAYER.match(name)
    if not match:
        return []
    layer, rest = int(match.group(1)), match.group(2)
    if layer >= config.num_layers:
        return []
    base = f"model.layers.{layer}."
    moe = config.is_moe_layer(layer)

    match = _ATTN_RES.match(rest)
    if match:
        part = match.group(2) or match.group(3)
        return [Piece(f"{base}{match.group(1)}.{part}.weight", reshape=True)]
    if rest.startswith("self_attn.forget_gate."):
        leaf = rest[len("self_attn.forget_gate."):]
        return [Piece(f"{base}self_attn.{leaf}", reshape=leaf == "A_log")]
    if rest == "self_attn.A_log":
        return [Piece(f"{base}self_attn.A_log", reshape=True)]
    if rest == "self_attn.conv1d.weight":
        width = config.kda_num_heads * config.kda_head_dim
        return [Piece(f"{base}self_attn.{p}_conv1d.weight", source=slice(i * width, (i + 1) * width))
                for i, p in enumerate("qkv")]
    match = _EXPERT.match(rest)
    if match:
        if not moe or match.group(3) == "weight_scale":
            return []  # a weight_scale is read together with its weight_packed sibling
        return [Piece(f"{base}block_sparse_moe.{match.group(2)}", expert=int(match.group(1)),
                      mxfp4=match.group(3) == "weight_packed")]
    if rest == "mlp.experts.gate_up_proj" and moe:
        f = config.moe_intermediate_size
        return [Piece(f"{base}block_sparse_moe.w1", source=slice(0, f), source_dim=1),
                Piece(f"{base}block_sparse_moe.w3", source=slice(f, 2 * f), source_dim=1)]
    if rest == "mlp.experts.down_proj" and moe:
        return [Piece(f"{base}block_sparse_moe.w2")]
    if moe and rest.startswith("mlp.") and rest[len("mlp."):].startswith(_MOE_SUBMODULES):
        return [Piece(f"{base}block_sparse_moe.{rest[len('mlp.'):]}")]
    if not moe and rest.startswith("block_sparse_moe.") and rest[len("block_sparse_moe."):] in _DENSE_MLP:
        return [Piece(f"{base}mlp.{rest[len('block_sparse_moe.'):]}")]
    return []


def expert_names(native_name: str, num_experts: int, fmt: str, mxfp4: bool) -> list[str]:
    """Published names of a stacked native expert tensor, one or two per expert (without the prefix)."""
    base, proj = native_name.rsplit(".", 1)
    leaves = ("weight_packed", "weight_scale") if mxfp4 else ("weight",)
    return [f"{base}.experts.{e}.{proj}.{leaf}" for e in range(num_experts) for leaf in leaves]


def native_to_checkpoint(native_name: str, fmt: str) -> str:
    """Published name of a non-expert native tensor (without the `language_model.` prefix)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    for mix in ("self_attention_res", "mlp_res", "output_attn_res"):
        for part in ("proj", "norm"):
            native = f"{mix}.{part}.weight"
            if native_name.endswith(native):
                return native_name[: -len(native)] + f"{mix}_{part}.weight"
    return native_name


def is_stacked_expert(native_name: str) -> bool:
    return native_name.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".block_sparse_moe." in native_name
