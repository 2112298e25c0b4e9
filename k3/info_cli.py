"""`k3 info`: a preset's (or a config file's) shape and parameter counts, computed without allocating; with
--kernels, the kernel switches as resolved here (k3.kernels)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3.config import PRESETS, ModelConfig
from k3.hf_config import from_hf_config
from k3.vision.config import VISION_PRESETS


def load_config(preset: str | None, config_path: str | None) -> ModelConfig:
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        values = json.loads(path.read_text())
        is_hf = "model_type" in values or "text_config" in values
        return from_hf_config(values) if is_hf else ModelConfig.from_dict(values)
    return ModelConfig.from_preset(preset or "tiny")


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(int(n))


def load_vision_config(args: argparse.Namespace):
    """The vision part to count: --vision PRESET, else the config file's vision_config, else K3's tower for
    --preset k3 (the released model is multimodal), else none ('none' turns it off)."""
    from k3.vision.config import VisionConfig, vision_config_from_hf

    if args.vision == "none":
        return None
    if args.vision:
        return VisionConfig.from_preset(args.vision)
    if args.config:
        values = json.loads(Path(args.config).read_text())
        return vision_config_from_hf(values) if isinstance(values.get("vision_config"), dict) else None
    return VisionConfig.from_preset("k3") if (args.preset or "tiny") == "k3" else None


def print_kernels(as_json: bool, as_markdown: bool) -> int:
    """The kernel switches: resolved now (text or JSON), or as declared (Markdown, docs/gpu.md's table)."""
    from k3 import kernels

    if as_markdown:
        print(kernels.markdown_table(), end="")
        return 0
    rows = kernels.resolved()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    name_width, env_width = max(len(row["name"]) for row in rows), max(len(row["env"]) for row in rows)
    for row in rows:
        note = "" if row["source"] == "default" else f"  (from {row['source']})"
        print(f"{row['name']:<{name_width}}  {row['env']:<{env_width}}  {row['choice']:<8}  "
              f"of {', '.join(row['choices'])}{note}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from k3.model import count_parameters

    if args.kernels or args.markdown:
        return print_kernels(args.json, args.markdown)

    config = load_config(args.preset, args.config)
    counts = count_parameters(config)
    vision = load_vision_config(args)
    if vision is not None:
        from k3.vision.model import count_vision_parameters

        # Text counts stay as they were; the vision part is reported beside them, not folded in.
        counts.update(count_vision_parameters(vision))
    report = {
        "preset": args.preset if not args.config else None,
        **counts,
        "layers": config.num_layers,
        "kda_layers": config.layer_types.count("kda"),
        "mla_layers": config.layer_types.count("mla"),
        "moe_layers": config.num_moe_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"preset          {report['preset'] or args.config}")
    print(f"layers          {config.num_layers} ({report['kda_layers']} KDA + {report['mla_layers']} MLA; "
          f"{config.num_moe_layers} MoE)")
    print(f"hidden / vocab  {config.hidden_size} / {config.vocab_size}")
    print(f"experts         {config.num_experts} routed (top-{config.num_experts_per_tok}) + "
          f"{config.num_shared_experts} shared; latent {config.moe_latent_size or 'none'}")
    print(f"AttnRes block   {config.attn_res_block_size or 'off (plain residuals)'}")
    print(f"total params    {counts['total_params']:,} ({_human(counts['total_params'])})")
    print(f"active params   {counts['active_params']:,} ({_human(counts['active_params'])}) "
          f"per token, excluding the input embedding")
    if vision is not None:
        print(f"vision params   {counts['vision_params']:,} ({_human(counts['vision_params'])}): tower "
              f"{_human(counts['vision_tower_params'])} ({vision.num_layers} layers, width {vision.hidden_size}) + "
              f"projector {_human(counts['mm_projector_params'])} ({vision.projector}); not in the totals above")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("info", help="show a model's shape and parameter counts (no allocation)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="named preset (default: tiny)")
    parser.add_argument("--config", default=None, help="a config.json (k3 or Hugging Face format) instead")
    parser.add_argument("--vision", choices=["none", *sorted(VISION_PRESETS)], default=None,
                        help="also count a vision tower + projector (default: the config file's vision_config, or "
                             "K3's tower for --preset k3)")
    parser.add_argument("--json", action="store_true", help="print JSON with total_params and active_params")
    parser.add_argument("--kernels", action="store_true",
                        help="print the kernel switches (k3/kernels.py) as resolved here, with --json as JSON")
    parser.add_argument("--markdown", action="store_true",
                        help="print the declared kernel switches as docs/gpu.md's Markdown table")
    parser.set_defaults(func=run_info)
