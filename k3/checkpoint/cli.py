"""`k3 convert`: move a model between checkpoint layouts.

    k3 convert --from DIR --to DIR --format kimi_k3 [--mxfp4] [--dtype bfloat16] [--max-shard-size 5GB]

The source is an HF-format directory (Kimi-Linear or Kimi-K3, detected from config.json) or a native k3
checkpoint (a run directory holding checkpoint.pt or a sharded checkpoint/, or either one itself). The target is an HF-format directory in the
chosen layout, or with --format native a native checkpoint (DIR/checkpoint.pt) holding the model, its config
and the tokenizer files.
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


class _TokenizerFiles:
    """Tokenizer files carried as bytes (as a native checkpoint stores them), written out unchanged."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def save(self, directory: str | Path) -> None:
        from k3.checkpoint.native import atomic_write_bytes

        for name, data in self.files.items():
            atomic_write_bytes(Path(directory) / name, data)


def _load(source: Path, dtype: str | None):
    from k3.checkpoint.hf_load import from_pretrained, parse_dtype
    from k3.checkpoint.hf_tokenizer import load_hf_tokenizer
    from k3.checkpoint.run import load_run_model

    if not source.exists():
        raise FileNotFoundError(f"--from {source} does not exist")
    if source.is_dir() and _is_hf_directory(source):
        return from_pretrained(source, dtype=dtype), load_hf_tokenizer(source, required=False)
    model, state = load_run_model(source)
    if dtype is not None:
        model = model.to(parse_dtype(dtype))
    files = state.get("tokenizer") or {}
    return model, (_TokenizerFiles(files) if files else None)


def _save_native(model, tokenizer, target: Path) -> Path:
    import tempfile

    from k3.checkpoint import native

    files: dict[str, bytes] = {}
    if tokenizer is not None:
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer.save(scratch)
            files = native.directory_files(scratch)
    path = target / native.CHECKPOINT_NAME if target.suffix != ".pt" else target
    native.save_checkpoint(path, {"model": model.state_dict(), "config": model.config.to_dict(), "step": 0,
                                  "tokenizer": files})
    return path


def convert(args: argparse.Namespace) -> int:
    from k3.checkpoint.hf_save import save_pretrained

    source, target = Path(args.source), Path(args.target)
    if source.resolve() == target.resolve():
        raise ValueError("--from and --to name the same path; write the converted checkpoint elsewhere")
    if args.mxfp4 and args.format != "kimi_k3":
        raise ValueError(f"--mxfp4 applies to --format kimi_k3 only, not {args.format}")
    model, tokenizer = _load(source, args.dtype)
    if args.format == "native":
        written = _save_native(model, tokenizer, target)
    else:
        written = save_pretrained(model, tokenizer, target, format=args.format, mxfp4_experts=args.mxfp4,
                                  max_shard_size=args.max_shard_size)
    experts = " (routed experts in MXFP4)" if args.mxfp4 else ""
    print(f"wrote {written} as {args.format}{experts}: {model.config.num_layers} layers, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a checkpoint between k3 and Hugging Face layouts (Kimi-Linear, Kimi-K3)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True,
                        help="source: HF-format directory, or a k3 run directory / its checkpoint.pt / its sharded "
                             "checkpoint/")
    parser.add_argument("--to", dest="target", required=True, help="target directory (replaced atomically)")
    parser.add_argument("--format", choices=[*FORMATS, "native"], default="kimi_k3",
                        help="target layout (default: kimi_k3)")
    parser.add_argument("--mxfp4", action="store_true", help="store routed experts in MXFP4 (kimi_k3 only)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast the weights on load (default: keep the stored dtypes)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    parser.set_defaults(func=convert)
