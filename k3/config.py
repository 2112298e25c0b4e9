"""ModelConfig: every architectural switch of a K3-family model, plus the named presets.

One dataclass documents every field (as DeepSeek-V3's inference code does). Layer indices in
public config.json files are 1-based (`full_attn_layers`, `kda_layers`); here `layer_types` is a
0-based list of "kda" / "mla", derived from those lists when they are given.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

ATTENTION_TYPES = ("kda", "mla")
KDA_GATES = ("softplus", "lower_bound")
KDA_OUTPUT_GATES = ("full_rank", "low_rank")
ACTIVATIONS = ("silu", "situ")
BALANCINGS = ("quantile", "loss_free", "none")


@dataclass
class ModelConfig:
    # --- embedding and stack -------------------------------------------------------------------
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    # 1-based indices of the global (MLA) layers; every other layer is KDA. Ignored when
    # `layer_types` is given explicitly.
    full_attn_layers: list[int] | None = None
    # 0-based per-layer attention type, "kda" or "mla". Derived in __post_init__ when None.
    layer_types: list[str] | None = None

    # --- Kimi Delta Attention ------------------------------------------------------------------
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_kernel: int = 4
    # "lower_bound": g = lb * sigmoid(exp(A_log) * (x + dt_bias)), g in (lb, 0)  (K3)
    # "softplus":    g = -exp(A_log) * softplus(x + dt_bias)                    (Kimi Linear)
    kda_gate: str = "lower_bound"
    gate_lower_bound: float = -5.0
    # "full_rank": one g_proj hidden -> H*dk (K3); "low_rank": g_a (hidden -> dk), g_b (dk -> H*dk).
    kda_output_gate: str = "full_rank"
    # Length of the stored A_log vector: K3 checkpoints store a longer one than the head count
    # and use only its first H entries. None means exactly H.
    kda_a_log_size: int | None = None

    # --- Gated Multi-head Latent Attention (no rotary anywhere: NoPE) ---------------------------
    mla_num_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True
    # eps of the q/kv latent RMSNorms; None = rms_norm_eps. Kimi Linear (transformers and Moonshot's code)
    # builds these two norms with a fixed 1e-6.
    mla_latent_norm_eps: float | None = None

    # --- Attention Residuals (block form); 0 = plain residual connections -----------------------
    attn_res_block_size: int = 12

    # --- MLP / MoE -----------------------------------------------------------------------------
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792  # dense MLP width
    num_experts: int = 896
    num_experts_per_tok: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072  # one routed expert's GLU width
    # Fused width of the shared experts; None = moe_intermediate_size * num_shared_experts.
    shared_expert_intermediate_size: int | None = None
    # Routed experts run in this latent width (LatentMoE); None = full hidden width.
    moe_latent_size: int | None = 3584
    moe_latent_norm: bool = True
    routed_scaling_factor: float = 1.0
    router_renormalize: bool = True
    hidden_act: str = "situ"
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0
    # Expert balancing: "quantile" (QB, K3), "loss_free" (DeepSeek-V3 sign update) or "none".
    moe_balancing: str = "quantile"
    loss_free_gamma: float = 1e-3

    # --- special tokens (informational; the tokenizer is the authority) ------------------------
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.layer_types is None:
            full = set(self.full_attn_layers or [])
            bad = sorted(i for i in full if not 1 <= i <= self.num_layers)
            if bad:
                raise ValueError(
                    f"full_attn_layers are 1-based layer numbers in [1, {self.num_layers}]; got out-of-range {bad}"
                )
            self.layer_types = ["mla" if i + 1 in full else "kda" for i in range(self.num_layers)]
        else:
            self.layer_types = list(self.layer_types)
            self.full_attn_layers = [i + 1 for i, t in enumerate(self.layer_types) if t == "mla"]
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(len(self.layer_types) == self.num_layers,
             f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
        for t in self.layer_types:
            need(t in ATTENTION_TYPES, f"layer type {t!r} is unknown; use one of {ATTENTION_TYPES}")
        need(self.kda_gate in KDA_GATES, f"kda_gate={self.kda_gate!r}; use one of {KDA_GATES}")
        need(self.kda_gate != "lower_bound" or self.gate_lower_bound < 0,
             f"gate_lower_bound must be negative (a log-decay floor), got {self.gate_lower_bound}")
        need(self.kda_output_gate in KDA_OUTPUT_GATES,
             f"kda_output_gate={self.kda_output_gate!r}; use one of {KDA_OUTPUT_GATES}")
        need(self.hidden_act in ACTIVATIONS, f"hidden_act={self.hidden_act!r}; use one of {ACTIVATIONS}")
        need(self.moe_balancing in BALANCINGS, f"moe_balancing={self.moe_balancing!r}; use one of {BALANCINGS}")
        need(self.attn_res_block_size >= 0, f"attn_res_block_size must be >= 0 (0 = plain residuals), "
             f"got {self.attn_res_block_size}")
        need(0 <= self.first_k_dense_replace <= self.num_layers,
             f"first_k_dense_replace must be in [0, num_layers={self.num_layers}], got {self.first_k_dense_replace}")
        if self.num_moe_layers:
            need(1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        for name in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim", "mla_num_heads",
                     "kv_lora_rank", "v_head_dim", "intermediate_size", "moe_intermediate_size"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.kda_a_log_size is None or self.kda_a_log_size >= self.kda_num_heads,
             f"kda_a_log_size={self.kda_a_log_size} is shorter than kda_num_heads={self.kda_num_heads}")

    # --- derived -------------------------------------------------------------------------------
    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @property
    def shared_width(self) -> int:
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def expert_input_size(self) -> int:
        return self.moe_latent_size or self.hidden_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # --- presets and (de)serialisation ---------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        values = dict(PRESETS[name])
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields are {sorted(known)}")
        values = dict(values)
        if values.get("layer_types") is not None:
            values.pop("full_attn_layers", None)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _every_fourth_and_last(num_layers: int) -> list[int]:
    """K3 / Kimi Linear pattern: MLA at 1-based layers 4, 8, ... and always at the last layer."""
    layers = list(range(4, num_layers + 1, 4))
    if num_layers not in layers:
        layers.append(num_layers)
    return layers


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds-fast tests: 4 layers (KDA, MLA, KDA, MLA), AttnRes block 2, every feature on.
    "debug": dict(
        vocab_size=256, hidden_size=64, num_layers=4, full_attn_layers=[2, 4],
        kda_num_heads=2, kda_head_dim=16,
        mla_num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        attn_res_block_size=2,
        intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        moe_intermediate_size=32, moe_latent_size=32,
    ),
    # The CPU demo: trains on 2 cores in minutes.
    "tiny": dict(
        vocab_size=4096, hidden_size=192, num_layers=8, full_attn_layers=[4, 8],
        kda_num_heads=3, kda_head_dim=64,
        mla_num_heads=3, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=64,
        attn_res_block_size=4,
        intermediate_size=512, num_experts=16, num_experts_per_tok=2, num_shared_experts=1,
        moe_intermediate_size=192, moe_latent_size=128,
    ),
    # One GPU: ~1.8B total, K3 features at Kimi-Linear-like small scale.
    "small": dict(
        vocab_size=32768, hidden_size=1024, num_layers=16, full_attn_layers=[4, 8, 12, 16],
        kda_num_heads=8, kda_head_dim=128,
        mla_num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
        attn_res_block_size=4,
        intermediate_size=4096, num_experts=64, num_experts_per_tok=6, num_shared_experts=1,
        moe_intermediate_size=1024, moe_latent_size=512,
    ),
    # transformers' KimiLinearConfig defaults with the released layer lists.
    "kimi-linear-48b": dict(
        vocab_size=163840, hidden_size=2304, num_layers=27, full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
        kda_num_heads=32, kda_head_dim=128, kda_gate="softplus", kda_output_gate="low_rank",
        mla_num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_output_gate=False, mla_latent_norm_eps=1e-6,
        attn_res_block_size=0,
        first_k_dense_replace=1, intermediate_size=9216,
        num_experts=256, num_experts_per_tok=8, num_shared_experts=1, moe_intermediate_size=1024,
        moe_latent_size=None, moe_latent_norm=False, routed_scaling_factor=2.446,
        hidden_act="silu", moe_balancing="loss_free",
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    ),
    # The released Kimi K3 text model (all defaults above are K3's).
    "k3": dict(full_attn_layers=_every_fourth_and_last(93), kda_a_log_size=128),
}
