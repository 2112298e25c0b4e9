"""`k3 convert`: move a model between checkpoint layouts.

    k3 convert --from DIR --to DIR --format kimi_k3 [--mxfp4] [--dtype bfloat16] [--max-shard-size 5GB]

The source is an HF-format directory (Kimi-Linear or Kimi-K3, detected from config.json) or a native k3
checkpoint (a run directory holding checkpoint.pt or a sharded checkpoint/, or either one itself). The target is an HF-format directory in the
chosen layout, or with --format native a native checkpoint (DIR/checkpoint.pt) holding the model, its config
and the tokenizer files.

The vision part (`vision_tower.*`, `mm_projector.*`: a K3 / Kimi-K2.5 directory with a vision_config, or a run
trained on image-text data) is carried both ways: into kimi_k3 (with vision_config and
media_placeholder_token_id) and into native (keys vision, vision_config, media_token_id). kimi_linear has no
place for it, so converting a model with a vision tower to kimi_linear is refused.

The target must not exist or be empty (--force replaces it, contents and all), and may not hold the source
or lie inside it. Everything is written into a new hidden directory beside it, renamed into place at the end:
a conversion that fails leaves the target as it was.
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
        from k3.atomic import atomic_write_bytes

        for name, data in self.files.items():
            atomic_write_bytes(Path(directory) / name, data)


def _load(source: Path, dtype: str | None):
    """(text model, tokenizer or None, (VisionModel, media token id) or None)."""
    from k3.checkpoint.hf_load import from_pretrained, parse_dtype
    from k3.data.hf_tokenizer import load_hf_tokenizer
    from k3.checkpoint.run import load_run_model

    if not source.exists():
        raise FileNotFoundError(f"--from {source} does not exist")
    if source.is_dir() and _is_hf_directory(source):
        return (from_pretrained(source, dtype=dtype), load_hf_tokenizer(source, required=False),
                _hf_vision(source, dtype))
    model, state = load_run_model(source)
    if dtype is not None:
        model = model.to(parse_dtype(dtype))
    files = state.get("tokenizer") or {}
    return model, (_TokenizerFiles(files) if files else None), _native_vision(state, str(source), dtype)


def _hf_vision(source: Path, dtype: str | None):
    """The vision part of an HF directory whose config.json has a vision_config, else None."""
    from k3.multimodal import DEFAULT_MEDIA_TOKEN_ID
    from k3.checkpoint.hf_vision import load_vision

    raw = json.loads((source / "config.json").read_text())
    if "vision_config" not in raw:
        return None
    media = raw.get("media_placeholder_token_id", raw.get("image_token_id", DEFAULT_MEDIA_TOKEN_ID))
    return load_vision(source, dtype), int(media)


def _native_vision(state: dict, source: str, dtype: str | None):
    """The vision part a native checkpoint keeps (a run trained on image-text data), else None."""
    from k3.checkpoint.hf_load import parse_dtype
    from k3.checkpoint.run import vision_from_checkpoint

    found = vision_from_checkpoint(state, source)
    if found is None or dtype is None:
        return found
    return found[0].to(parse_dtype(dtype)), found[1]


def _save_native(model, tokenizer, target: Path, vision=None) -> Path:
    import shutil
    import tempfile

    from k3.checkpoint import native
    from k3.checkpoint.hf_save import replace_directory

    files: dict[str, bytes] = {}
    if tokenizer is not None:
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer.save(scratch)
            files = native.directory_files(scratch)
    state = {"model": model.state_dict(), "config": model.config.to_dict(), "step": 0, "tokenizer": files}
    if vision is not None:
        tower, media = vision
        state.update(vision=tower.state_dict(), vision_config=tower.config.to_dict(), media_token_id=media)
    if target.suffix == ".pt":  # one file: written beside itself and renamed over
        native.save_checkpoint(target, state)
        return target
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        native.save_checkpoint(staging / native.CHECKPOINT_NAME, state)
        replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target / native.CHECKPOINT_NAME


def check_target(source: Path, target: Path, force: bool) -> None:
    """Refuse a target that holds or lies inside the source, or (without force) one that holds anything."""
    source, target = source.resolve(), target.resolve()
    if source == target or source.is_relative_to(target) or target.is_relative_to(source):
        raise ValueError(f"--to {target} and --from {source} overlap (one holds the other); writing there would "
                         f"replace the source. Write the converted checkpoint elsewhere")
    if force or not target.exists():
        return
    if target.is_dir():
        entries = sorted(p.name for p in target.iterdir())
        if entries:
            raise ValueError(f"--to {target} is not empty ({len(entries)} entries, e.g. {entries[:3]}); k3 convert "
                             f"writes only to a new or empty directory. Choose another --to, or pass --force to "
                             f"replace it and everything in it")
    else:
        raise ValueError(f"--to {target} is an existing file; choose another --to, or pass --force to replace it")


def convert(args: argparse.Namespace) -> int:
    from k3.checkpoint.hf_save import save_pretrained

    source, target = Path(args.source), Path(args.target)
    if args.mxfp4 and args.format != "kimi_k3":
        raise ValueError(f"--mxfp4 applies to --format kimi_k3 only, not {args.format}")
    if not source.exists():
        raise FileNotFoundError(f"--from {source} does not exist")
    check_target(source, target, args.force)
    if target.is_file() and args.format != "native":
        raise ValueError(f"--to {target} is a file; the {args.format} layout is a directory: choose another --to")
    model, tokenizer, vision = _load(source, args.dtype)
    if vision is not None and args.format not in ("kimi_k3", "native"):
        raise ValueError(f"--from {source} has a vision tower, which the {args.format} layout has no place for; "
                         f"use --format kimi_k3 or native to keep it")
    if args.format == "native":
        written = _save_native(model, tokenizer, target, vision)
    elif vision is not None:
        tower, media = vision
        written = save_pretrained(model, tokenizer, target, format=args.format, mxfp4_experts=args.mxfp4,
                                  max_shard_size=args.max_shard_size, vision=tower,
                                  extra_config={"media_placeholder_token_id": media})
    else:
        written = save_pretrained(model, tokenizer, target, format=args.format, mxfp4_experts=args.mxfp4,
                                  max_shard_size=args.max_shard_size)
    experts = " (routed experts in MXFP4)" if args.mxfp4 else ""
    with_vision = (f" + vision tower and projector, {sum(p.numel() for p in vision[0].parameters()):,} parameters"
                   if vision is not None else "")
    print(f"wrote {written} as {args.format}{experts}: {model.config.num_layers} layers, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters{with_vision}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a checkpoint between k3 and Hugging Face layouts (Kimi-Linear, Kimi-K3)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True,
                        help="source: HF-format directory, or a k3 run directory / its checkpoint.pt / its sharded "
                             "checkpoint/")
    parser.add_argument("--to", dest="target", required=True,
                        help="target directory: new or empty (written beside it, renamed into place)")
    parser.add_argument("--force", action="store_true",
                        help="replace a --to that already holds files (everything in it is deleted)")
    parser.add_argument("--format", choices=[*FORMATS, "native"], default="kimi_k3",
                        help="target layout (default: kimi_k3)")
    parser.add_argument("--mxfp4", action="store_true", help="store routed experts in MXFP4 (kimi_k3 only)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast the weights on load (default: keep the stored dtypes)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    parser.set_defaults(func=convert)
