"""VisionConfig: every switch of the MoonViT3d tower and its projector, the presets, and the config.json forms.

Two published variants share one tower (SPEC §10):

    field                Kimi-K2.5                               K3
    width / MLP          1152 / 4304                             1024 / 4096
    heads x head_dim     16 x 72                                 12 x 128 (QKV width 1536 != width)
    norms, biases        LayerNorm (eps 1e-5), biases            RMSNorm, no biases
    position grid        learned 64x64, bicubic resize           learned 64x64, bilinear resize
    projector            patchmerger: LayerNorm per patch,       patchmergerv2: Linear 4096->4096,
                         Linear 4608->4608, GELU, Linear (bias)  exact GELU, Linear (no bias), RMSNorm

config.json spellings read here:
- the published (Moonshot) `vision_config`: vt_hidden_size, vt_num_attention_heads, qkv_hidden_size, norm_type,
  attn_bias, linear_bias, patch_embed_proj_bias, init_pos_emb_{height,width,time}, pos_emb_interpolation_mode,
  mm_projector_type, projector_ln_eps, text_hidden_size, ...;
- transformers' `kimi_k25` (Kimi_K25VisionConfig: hidden_size, num_attention_heads, pos_emb_height, ...;
  projection_layer_norm_eps at the top level and the text width in text_config).
Fields a file leaves out take the defaults of its model type (kimi_k25: the K2.5 column; otherwise K3's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

NORM_TYPES = ("rmsnorm", "layernorm")
INTERPOLATIONS = ("bilinear", "bicubic")
PROJECTORS = ("patchmerger", "patchmergerv2")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass
class VisionConfig:
    # --- patches ------------------------------------------------------------------------------
    patch_size: int = 14
    in_channels: int = 3
    # --- transformer --------------------------------------------------------------------------
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 27
    num_heads: int = 12
    # Per-head width of q/k/v; the QKV width num_heads * head_dim may differ from hidden_size (K3: 1536 vs 1024).
    head_dim: int = 128
    hidden_act: str = "gelu_pytorch_tanh"  # "gelu_pytorch_tanh" (tanh approximation) or "gelu" (exact erf)
    norm_type: str = "rmsnorm"
    # eps of the tower's norms. None: the input dtype's machine epsilon (torch.nn.RMSNorm's default, which the
    # public K3 tower uses); Kimi-K2.5's LayerNorms use 1e-5.
    norm_eps: float | None = None
    attn_bias: bool = False  # wqkv, wo
    mlp_bias: bool = False  # mlp.fc0, mlp.fc1
    patch_bias: bool = False  # patch_embed.proj
    rope_theta: float = 10000.0
    # --- positions ----------------------------------------------------------------------------
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # most frames a clip may have (the sincos time table's length)
    pos_emb_interpolation: str = "bilinear"
    # --- merging and projector ----------------------------------------------------------------
    merge_kernel: tuple[int, int] = (2, 2)
    projector: str = "patchmergerv2"
    projector_act: str = "gelu"
    projector_eps: float = 1e-5
    text_hidden_size: int = 7168
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        self.merge_kernel = tuple(int(k) for k in self.merge_kernel)  # type: ignore[assignment]
        checks = [
            (self.norm_type in NORM_TYPES, f"norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}"),
            (self.pos_emb_interpolation in INTERPOLATIONS,
             f"pos_emb_interpolation must be one of {INTERPOLATIONS}, got {self.pos_emb_interpolation!r}"),
            (self.projector in PROJECTORS, f"projector must be one of {PROJECTORS}, got {self.projector!r}"),
            (self.hidden_act in ACTIVATIONS, f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}"),
            (self.projector_act in ACTIVATIONS,
             f"projector_act must be one of {ACTIVATIONS}, got {self.projector_act!r}"),
            (self.head_dim % 4 == 0, f"head_dim must be divisible by 4 (2D rotary: a quarter of it per axis "
                                     f"and pair slot), got {self.head_dim}"),
            (len(self.merge_kernel) == 2 and min(self.merge_kernel) >= 1,
             f"merge_kernel must be two positive ints, got {self.merge_kernel}"),
            (min(self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads, self.patch_size,
                 self.pos_emb_height, self.pos_emb_width, self.pos_emb_time) >= 1,
             "sizes, counts and the position grid must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"VisionConfig: {message}")

    @property
    def qkv_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def merge_area(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]

    @property
    def merged_width(self) -> int:
        """Width of one merged token entering the projector (merge_area patches side by side)."""
        return self.hidden_size * self.merge_area

    # --- presets and (de)serialisation ---------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "VisionConfig":
        if name not in VISION_PRESETS:
            raise ValueError(f"unknown vision preset {name!r}; choose one of {sorted(VISION_PRESETS)}")
        values = dict(VISION_PRESETS[name])
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["merge_kernel"] = list(self.merge_kernel)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "VisionConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown VisionConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)


K25_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1152, intermediate_size=4304, num_layers=27, num_heads=16, head_dim=72,
    norm_type="layernorm", norm_eps=1e-5, attn_bias=True, mlp_bias=True, patch_bias=True,
    pos_emb_interpolation="bicubic", projector="patchmerger", text_hidden_size=7168,
)

VISION_PRESETS: dict[str, dict[str, Any]] = {
    "k3": {},  # the dataclass defaults are K3's
    "kimi-k2.5": dict(K25_DEFAULTS),
    # Seconds-fast tests and the CPU vision-language demo: every K3 switch on (QKV width != width).
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, head_dim=48,
                 pos_emb_height=16, pos_emb_width=16, text_hidden_size=192),
}


# --- config.json ------------------------------------------------------------------------------------------
# (our field, published vision_config names, transformers Kimi_K25VisionConfig names)
_ALIASES: list[tuple[str, tuple[str, ...]]] = [
    ("patch_size", ("patch_size",)),
    ("hidden_size", ("vt_hidden_size", "hidden_size")),
    ("intermediate_size", ("vt_intermediate_size", "intermediate_size")),
    ("num_layers", ("vt_num_hidden_layers", "num_hidden_layers")),
    ("num_heads", ("vt_num_attention_heads", "num_attention_heads")),
    ("hidden_act", ("activation_func", "hidden_act")),
    ("norm_type", ("norm_type",)),
    ("norm_eps", ("norm_eps",)),
    ("attn_bias", ("attn_bias",)),
    ("mlp_bias", ("linear_bias",)),
    ("patch_bias", ("patch_embed_proj_bias",)),
    ("rope_theta", ("rope_theta",)),
    ("pos_emb_height", ("init_pos_emb_height", "pos_emb_height")),
    ("pos_emb_width", ("init_pos_emb_width", "pos_emb_width")),
    ("pos_emb_time", ("init_pos_emb_time", "pos_emb_time")),
    ("pos_emb_interpolation", ("pos_emb_interpolation_mode",)),
    ("merge_kernel", ("merge_kernel_size",)),
    ("projector", ("mm_projector_type",)),
    ("projector_act", ("projector_hidden_act",)),
    ("projector_eps", ("projector_ln_eps",)),
    ("text_hidden_size", ("text_hidden_size",)),
]
# Published switches whose other values k3 does not implement: refuse instead of running wrong.
_FIXED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mlp_type": "mlp2",
          "video_attn_type": "spatial_temporal"}


def vision_config_from_hf(hf: dict[str, Any]) -> VisionConfig:
    """VisionConfig from a whole config.json dict (K3 or transformers kimi_k25) that holds a `vision_config`."""
    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError("config.json has no vision_config object; it describes a text-only model "
                         "(a K3 or kimi_k25 multimodal checkpoint carries one)")
    for key, wanted in _FIXED.items():
        if key in vision and vision[key] != wanted:
            raise ValueError(f"vision_config {key}={vision[key]!r} is not supported; k3's MoonViT implements "
                             f"{key}={wanted!r}")
    k25 = hf.get("model_type") == "kimi_k25" or vision.get("model_type") == "kimi_k25_vision"
    values: dict[str, Any] = dict(K25_DEFAULTS) if k25 else {}
    for field, names in _ALIASES:
        for name in names:
            if vision.get(name) is not None:
                values[field] = vision[name]
                break
    hidden = int(values.get("hidden_size", VisionConfig.hidden_size))
    heads = int(values.get("num_heads", VisionConfig.num_heads))
    qkv = vision.get("qkv_hidden_size")
    if qkv:
        if int(qkv) % heads:
            raise ValueError(f"vision_config qkv_hidden_size {qkv} is not divisible by {heads} heads")
        values["head_dim"] = int(qkv) // heads
    elif vision.get("head_dim"):
        values["head_dim"] = int(vision["head_dim"])
    elif any(vision.get(n) is not None for n in ("vt_hidden_size", "hidden_size", "vt_num_attention_heads",
                                                  "num_attention_heads")):
        values["head_dim"] = hidden // heads  # no separate QKV width: q/k/v are as wide as the tower
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_theta") is not None:
        values["rope_theta"] = float(rope["rope_theta"])
    if k25:
        values.setdefault("norm_eps", 1e-5)
        if hf.get("projection_layer_norm_eps") is not None:
            values["projector_eps"] = float(hf["projection_layer_norm_eps"])
    text = hf.get("text_config") or {}
    if "text_hidden_size" not in vision and text.get("hidden_size"):
        values["text_hidden_size"] = int(text["hidden_size"])
    if values.get("hidden_act") == "gelu_tanh":
        values["hidden_act"] = "gelu_pytorch_tanh"
    return VisionConfig(**values)


def vision_config_to_hf(config: VisionConfig) -> dict[str, Any]:
    """The published (Moonshot) `vision_config` spelling, with every switch written out."""
    return {
        "patch_size": config.patch_size,
        "vt_hidden_size": config.hidden_size,
        "vt_intermediate_size": config.intermediate_size,
        "vt_num_hidden_layers": config.num_layers,
        "vt_num_attention_heads": config.num_heads,
        "qkv_hidden_size": config.qkv_width,
        "activation_func": config.hidden_act,
        "norm_type": config.norm_type,
        "norm_eps": config.norm_eps,
        "attn_bias": config.attn_bias,
        "linear_bias": config.mlp_bias,
        "patch_embed_proj_bias": config.patch_bias,
        "rope_theta": config.rope_theta,
        "init_pos_emb_height": config.pos_emb_height,
        "init_pos_emb_width": config.pos_emb_width,
        "init_pos_emb_time": config.pos_emb_time,
        "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": config.pos_emb_interpolation,
        "merge_kernel_size": list(config.merge_kernel),
        "merge_type": "sd2_tpool",
        "mlp_type": "mlp2",
        "video_attn_type": "spatial_temporal",
        "mm_projector_type": config.projector,
        "mm_hidden_size": config.hidden_size,
        "projector_hidden_act": config.projector_act,
        "projector_ln_eps": config.projector_eps,
        "text_hidden_size": config.text_hidden_size,
    }
