"""Conversion between ModelConfig and the public config.json formats.

Two formats exist:
- Kimi-Linear (`model_type: kimi_linear`), as transformers' KimiLinearConfig and Moonshot's release write it;
- Kimi-K3: a multimodal wrapper (`model_type: kimi_k3`) whose `text_config` is a Kimi-Linear-style dict with
  K3's extra switches (q_lora, MLA output gate, full-rank KDA gate, gate lower bound, latent MoE, AttnRes, SiTU).
Field aliases follow transformers' attribute_map (num_local_experts/num_experts, n_shared_experts/...).
"""

from __future__ import annotations

from typing import Any

from k3.config import ModelConfig

K3_WRAPPER_TYPES = ("kimi_k3", "kimi_k25")
TEXT_TYPES = ("kimi_linear", "kimi_k3_text", "kimi_k3")


def _first(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    return default


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (Kimi-Linear or the K3 multimodal wrapper)."""
    if not isinstance(hf, dict):
        raise ValueError(f"expected a config.json dict, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if "text_config" in hf:
        text = dict(hf["text_config"])
    elif model_type in TEXT_TYPES or model_type is None:
        text = hf
    else:
        raise ValueError(
            f"unknown model_type {model_type!r}: k3 reads 'kimi_linear' configs and the Kimi-K3 wrapper "
            f"('kimi_k3' with a text_config)"
        )
    linear = dict(text.get("linear_attn_config") or {})
    num_layers = int(_first(text, "num_hidden_layers", "num_layers"))
    full = linear.get("full_attn_layers")
    layer_types = text.get("layer_types")
    if full is not None:
        kda = linear.get("kda_layers") or []
        covered = sorted(set(full) | set(kda))
        if kda and covered != list(range(1, num_layers + 1)):
            raise ValueError(
                f"linear_attn_config lists {len(covered)} layers in full_attn_layers + kda_layers but the model has "
                f"{num_layers}: every 1-based layer must appear in exactly one list"
            )
        types = ["mla" if i + 1 in set(full) else "kda" for i in range(num_layers)]
    elif layer_types is not None:
        types = ["mla" if t in ("full_attention", "mla") else "kda" for t in layer_types]
    else:  # transformers' default pattern
        types = ["mla" if i and i % 4 == 0 else "kda" for i in range(num_layers)]

    lower_bound = _first(linear, "gate_lower_bound", "lower_bound", default=_first(text, "gate_lower_bound"))
    full_rank_gate = bool(_first(linear, "use_full_rank_gate", default=text.get("use_full_rank_gate", False)))
    first_k_dense = _first(text, "first_k_dense_replace", default=None)
    if first_k_dense is None and text.get("mlp_layer_types"):
        first_k_dense = sum(1 for t in text["mlp_layer_types"] if t == "dense")
        if any(t == "dense" for t in text["mlp_layer_types"][first_k_dense:]):
            raise ValueError(f"mlp_layer_types {text['mlp_layer_types']} puts dense layers after MoE layers; "
                             f"k3 supports dense layers only as a prefix (first_k_dense_replace)")
    num_shared = int(_first(text, "num_shared_experts", "n_shared_experts", default=1))
    moe_inter = int(_first(text, "moe_intermediate_size", default=1024))
    latent = _first(text, "routed_expert_hidden_size", "moe_latent_size")
    balancing = text.get("moe_balancing") or ("quantile" if model_type in K3_WRAPPER_TYPES or latent is not None
                                              else "loss_free")
    a_log_size = _first(linear, "a_log_size", default=None)
    return ModelConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_layers=num_layers,
        layer_types=types,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        initializer_range=float(text.get("initializer_range", 0.02)),
        kda_num_heads=int(_first(linear, "num_heads", default=_first(text, "linear_num_heads", default=32))),
        kda_head_dim=int(_first(linear, "head_dim", default=_first(text, "linear_head_dim", default=128))),
        kda_conv_kernel=int(_first(linear, "short_conv_kernel_size",
                                   default=_first(text, "linear_conv_kernel_dim", default=4))),
        kda_gate="lower_bound" if lower_bound is not None else "softplus",
        gate_lower_bound=float(lower_bound) if lower_bound is not None else -5.0,
        kda_output_gate="full_rank" if full_rank_gate else "low_rank",
        kda_a_log_size=int(a_log_size) if a_log_size else None,
        mla_num_heads=int(text.get("num_attention_heads", 32)),
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=int(text.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(text.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(text.get("qk_rope_head_dim", 64)),
        v_head_dim=int(text.get("v_head_dim", 128)),
        mla_output_gate=bool(_first(text, "mla_use_output_gate", "mla_output_gate", default=False)),
        # Kimi Linear's q/kv latent norms use a fixed eps of 1e-6 (transformers and Moonshot's modeling code);
        # K3's use rms_norm_eps.
        mla_latent_norm_eps=_first(text, "mla_latent_norm_eps", default=None if "text_config" in hf else 1e-6),
        attn_res_block_size=int(text.get("attn_res_block_size") or 0),
        first_k_dense_replace=int(first_k_dense if first_k_dense is not None else 1),
        intermediate_size=int(text.get("intermediate_size", 9216)),
        num_experts=int(_first(text, "num_experts", "num_local_experts", "n_routed_experts", default=256)),
        num_experts_per_tok=int(_first(text, "num_experts_per_token", "num_experts_per_tok", default=8)),
        num_shared_experts=num_shared,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=_first(text, "shared_expert_intermediate_size", default=None),
        moe_latent_size=int(latent) if latent is not None else None,
        moe_latent_norm=bool(_first(text, "latent_moe_use_norm", "moe_latent_norm", default=latent is not None)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        router_renormalize=bool(_first(text, "moe_renormalize", "norm_topk_prob", default=True)),
        hidden_act=str(text.get("hidden_act", "silu")),
        situ_beta_gate=float(_first(text, "activation_situ_beta", default=4.0)),
        situ_beta_up=float(_first(text, "activation_situ_linear_beta", default=25.0)),
        moe_balancing=balancing,
        bos_token_id=text.get("bos_token_id"),
        eos_token_id=text.get("eos_token_id") if not isinstance(text.get("eos_token_id"), list)
        else text["eos_token_id"][0],
        pad_token_id=text.get("pad_token_id"),
    )


def _text_dict(config: ModelConfig, model_type: str) -> dict[str, Any]:
    text: dict[str, Any] = {
        "model_type": model_type,
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.mla_num_heads,
        "num_key_value_heads": config.mla_num_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": config.num_shared_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "first_k_dense_replace": config.first_k_dense_replace,
        "routed_scaling_factor": config.routed_scaling_factor,
        "moe_renormalize": config.router_renormalize,
        "moe_router_activation_func": "sigmoid",
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "linear_attn_config": {
            "num_heads": config.kda_num_heads,
            "head_dim": config.kda_head_dim,
            "short_conv_kernel_size": config.kda_conv_kernel,
            "full_attn_layers": [i + 1 for i, t in enumerate(config.layer_types) if t == "mla"],
            "kda_layers": [i + 1 for i, t in enumerate(config.layer_types) if t == "kda"],
        },
    }
    if config.shared_expert_intermediate_size is not None:
        text["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return text


def to_hf_config(config: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """Write a config.json dict. Kimi-Linear-compatible models get the flat `kimi_linear` format;
    models using any K3-only switch get the K3 wrapper with a `text_config`."""
    k3_only = (config.kda_gate == "lower_bound" or config.kda_output_gate == "full_rank" or config.mla_output_gate
               or config.attn_res_block_size > 0 or config.moe_latent_size is not None or config.hidden_act == "situ")
    model_type = model_type or ("kimi_k3" if k3_only else "kimi_linear")
    if model_type == "kimi_linear":
        if k3_only:
            raise ValueError("this config uses K3-only switches (bounded gate, AttnRes, latent MoE, SiTU, gates); "
                             "it can only be written as model_type='kimi_k3'")
        return _text_dict(config, "kimi_linear")
    if model_type != "kimi_k3":
        raise ValueError(f"model_type must be 'kimi_linear' or 'kimi_k3', got {model_type!r}")
    text = _text_dict(config, "kimi_linear")
    linear = text["linear_attn_config"]
    linear["use_full_rank_gate"] = config.kda_output_gate == "full_rank"
    if config.kda_gate == "lower_bound":
        linear["gate_lower_bound"] = config.gate_lower_bound
    if config.kda_a_log_size is not None:
        linear["a_log_size"] = config.kda_a_log_size
    text.update({
        "mla_use_output_gate": config.mla_output_gate,
        "mla_use_nope": True,
        "attn_res_block_size": config.attn_res_block_size,
        "routed_expert_hidden_size": config.moe_latent_size,
        "latent_moe_use_norm": config.moe_latent_norm,
        "activation_situ_beta": config.situ_beta_gate,
        "activation_situ_linear_beta": config.situ_beta_up,
        "moe_balancing": config.moe_balancing,
    })
    if config.mla_latent_norm_eps is not None:
        text["mla_latent_norm_eps"] = config.mla_latent_norm_eps
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text}
