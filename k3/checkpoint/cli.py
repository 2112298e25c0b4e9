"""`k3 convert`: move a model between checkpoint layouts.

    k3 convert --from DIR --to DIR --format kimi_k3 [--mxfp4] [--dtype bfloat16] [--max-shard-size 5GB]

The source is an HF-format directory (Kimi-Linear or Kimi-K3, detected from config.json) or a native k3
checkpoint (read through k3.checkpoint.native when that module provides `load_model`). The target is an
HF-format directory in the chosen layout, or a native checkpoint with --format native.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3.checkpoint.hf_names import FORMATS


def _is_hf_directory(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(raw, dict) and ("model_type" in raw or "text_config" in raw)


def _native_module():
    try:
        from k3.checkpoint import native
    except ImportError as error:
        raise RuntimeError(f"native k3 checkpoints need k3.checkpoint.native, which is not importable ({error})") \
            from error
    return native


def _load(source: Path, dtype: str | None):
    from k3.checkpoint.hf_load import from_pretrained

    if not source.exists():
        raise FileNotFoundError(f"--from {source} does not exist")
    if _is_hf_directory(source):
        return from_pretrained(source, dtype=dtype)
    native = _native_module()
    if not hasattr(native, "load_model"):
        raise RuntimeError(f"{source} is not an HF-format directory (config.json with a model_type) and "
                           f"k3.checkpoint.native has no load_model(path) to read it as a native checkpoint")
    loaded = native.load_model(source)
    model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, None)
    if dtype is not None:
        from k3.checkpoint.hf_load import parse_dtype

        model = model.to(parse_dtype(dtype))
    return model, tokenizer


def convert(args: argparse.Namespace) -> int:
    from k3.checkpoint.hf_save import save_pretrained

    source, target = Path(args.source), Path(args.target)
    if source.resolve() == target.resolve():
        raise ValueError("--from and --to name the same directory; write the converted checkpoint elsewhere")
    model, tokenizer = _load(source, args.dtype)
    if args.format == "native":
        if args.mxfp4:
            raise ValueError("--mxfp4 applies to the kimi_k3 layout only; drop it for --format native")
        native = _native_module()
        if not hasattr(native, "save_model"):
            raise RuntimeError("k3.checkpoint.native has no save_model(model, tokenizer, path); cannot write a "
                               "native checkpoint")
        native.save_model(model, tokenizer, target)
    else:
        save_pretrained(model, tokenizer, target, format=args.format, mxfp4_experts=args.mxfp4,
                        max_shard_size=args.max_shard_size)
    experts = " (routed experts in MXFP4)" if args.mxfp4 else ""
    print(f"wrote {target} as {args.format}{experts}: {model.config.num_layers} layers, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a checkpoint between k3 and Hugging Face layouts (Kimi-Linear, Kimi-K3)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True, help="source directory (HF format or native k3)")
    parser.add_argument("--to", dest="target", required=True, help="target directory (replaced atomically)")
    parser.add_argument("--format", choices=[*FORMATS, "native"], default="kimi_k3",
                        help="target layout (default: kimi_k3)")
    parser.add_argument("--mxfp4", action="store_true", help="store routed experts in MXFP4 (kimi_k3 only)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast the weights on load (default: keep the stored dtypes)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    parser.set_defaults(func=convert)
