"""Write a K3ForCausalLM as a Hugging Face-format directory in the Kimi-Linear or Kimi-K3 layout.

- kimi_linear: Moonshot's released names (what transformers' KimiLinearForCausalLM loads and writes back):
  per-expert `block_sparse_moe.experts.{e}.w{1,2,3}.weight`, `self_attn.A_log` as [1, 1, H, 1].
- kimi_k3: the multimodal wrapper config (text_config), every name under `language_model.`, AttnRes pairs as
  `*_res_proj.weight` / `*_res_norm.weight`, routed experts per expert, optionally in MXFP4 (compressed-tensors
  `weight_packed` + `weight_scale`).

Tensors are produced one at a time and written shard by shard (safetensors, `model-0000i-of-0000N` plus an
index when there is more than one shard). The directory is assembled beside the target and renamed into place,
so a crash never leaves a half-written checkpoint under the target name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from k3.atomic import atomic_write_bytes
from k3.checkpoint.hf_names import FORMATS, INDEX_FILE, K3_PREFIX, SINGLE_FILE, is_stacked_expert, native_to_checkpoint
from k3.checkpoint.mxfp4 import GROUP_SIZE, quantize_mxfp4
from k3.hf_config import to_hf_config
from k3.model import K3ForCausalLM

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """5_000_000, "5GB", "500MiB" -> bytes."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count")
    return max(1, int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]))


def mxfp4_quantization_config() -> dict:
    """compressed-tensors' description of MXFP4 routed experts (everything else stays unquantised)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
            "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                        "group_size": GROUP_SIZE, "dynamic": False},
            "input_activations": None,
        }},
        "ignore": ["lm_head", r"re:.*vision_tower.*", r"re:.*mm_projector.*"],
    }


def checkpoint_tensors(model: K3ForCausalLM, fmt: str, mxfp4_experts: bool = False,
                       dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, tensor) pairs of a model in a layout, one tensor at a time (experts sliced lazily)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    config = model.config
    prefix = K3_PREFIX if fmt == "kimi_k3" else ""
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if is_stacked_expert(name):
            base, proj = name.rsplit(".", 1)
            for e in range(tensor.shape[0]):
                expert_name = f"{prefix}{base}.experts.{e}.{proj}"
                if mxfp4_experts:
                    packed, scale = quantize_mxfp4(tensor[e])
                    yield f"{expert_name}.weight_packed", packed
                    yield f"{expert_name}.weight_scale", scale
                else:
                    yield f"{expert_name}.weight", tensor[e].clone()
            continue
        if fmt == "kimi_linear" and name.endswith("self_attn.A_log"):
            # transformers keeps A_log as [1, 1, H, 1]; entries past the head count are unused.
            tensor = tensor[: config.kda_num_heads].reshape(1, 1, config.kda_num_heads, 1)
        yield prefix + native_to_checkpoint(name, fmt), tensor.contiguous()


def _check_exportable(model: K3ForCausalLM, fmt: str, mxfp4_experts: bool) -> None:
    config = model.config
    if mxfp4_experts and fmt != "kimi_k3":
        raise ValueError("MXFP4 experts exist only in the kimi_k3 layout; use format='kimi_k3' or mxfp4_experts=False")
    if mxfp4_experts and (config.expert_input_size % GROUP_SIZE or config.moe_intermediate_size % GROUP_SIZE):
        raise ValueError(f"MXFP4 needs expert input widths divisible by {GROUP_SIZE}; this model has latent/hidden "
                         f"{config.expert_input_size} and expert intermediate {config.moe_intermediate_size}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("the model still has meta (unloaded) tensors; load or initialise it before saving")
    if fmt == "kimi_linear" and config.mla_latent_norm_eps != 1e-6:
        warnings.warn(f"Kimi-Linear readers build the MLA latent norms with eps 1e-6; this model uses "
                      f"{config.mla_latent_norm_eps or config.rms_norm_eps}, so its outputs will shift slightly",
                      stacklevel=3)


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def replace_directory(staging: Path, target: Path) -> None:
    """Move a finished staging directory to `target`, replacing any old checkpoint there."""
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"{target} exists and is not a directory")
        retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.replace(target, retired / "old")
        os.replace(staging, target)
        shutil.rmtree(retired)
    else:
        os.replace(staging, target)


def save_pretrained(model: K3ForCausalLM, tokenizer, path: str | os.PathLike, format: str | None = None,
                    mxfp4_experts: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                    dtype: torch.dtype | None = None, progress: bool = True, vision=None,
                    extra_config: dict | None = None) -> Path:
    """Write model (+ tokenizer, if given) as an HF-format directory at `path`; returns the path.

    format: 'kimi_linear' or 'kimi_k3'; None picks kimi_linear when the config has no K3-only switch.
    mxfp4_experts: store routed experts in MXFP4 (kimi_k3 only). dtype: cast floating tensors first.
    vision: a k3.vision.VisionModel written beside the text as `vision_tower.*` / `mm_projector.*`, with its
    `vision_config` (kimi_k3 only; k3.checkpoint.hf_multimodal.save_pretrained passes it). extra_config: added to
    config.json."""
    config = model.config
    # raises when the config cannot be written in that format
    hf_config = to_hf_config(config, format or ("kimi_k3" if vision is not None else None))
    fmt = "kimi_k3" if hf_config.get("model_type") == "kimi_k3" else "kimi_linear"
    _check_exportable(model, fmt, mxfp4_experts)
    tensors = checkpoint_tensors(model, fmt, mxfp4_experts, dtype)
    if vision is not None:
        from k3.vision.checkpoint import vision_tensors
        from k3.vision.config import vision_config_to_hf

        if fmt != "kimi_k3":
            raise ValueError("a vision part exists only in the kimi_k3 layout; use format='kimi_k3'")
        hf_config["vision_config"] = vision_config_to_hf(vision.config)
        tensors = itertools.chain(tensors, vision_tensors(vision, dtype))
    hf_config.update(extra_config or {})
    limit = parse_size(max_shard_size)
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        shards: list[tuple[Path, list[str]]] = []
        current: dict[str, torch.Tensor] = {}
        current_bytes = total_bytes = 0
        for name, tensor in tqdm(tensors, desc="writing tensors", unit="tensor", disable=not progress):
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > limit:
                shards.append((staging / f"shard-{len(shards)}.tmp", list(current)))
                _write_shard(current, shards[-1][0])
                current, current_bytes = {}, 0
            current[name] = tensor
            current_bytes += size
            total_bytes += size
        if current or not shards:
            shards.append((staging / f"shard-{len(shards)}.tmp", list(current)))
            _write_shard(current, shards[-1][0])
        del current
        if len(shards) == 1:
            os.replace(shards[0][0], staging / SINGLE_FILE)
        else:
            weight_map = {}
            for i, (file, names) in enumerate(shards, start=1):
                final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                os.replace(file, staging / final)
                weight_map.update({n: final for n in names})
            index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write_bytes(staging / INDEX_FILE, json.dumps(index, indent=2).encode("utf-8"))
        stored_dtype = dtype or model.model.embed_tokens.weight.dtype
        hf_config["dtype"] = str(stored_dtype).removeprefix("torch.")
        if mxfp4_experts:
            hf_config["quantization_config"] = mxfp4_quantization_config()
        atomic_write_bytes(staging / "config.json", json.dumps(hf_config, indent=2).encode("utf-8"))
        if tokenizer is not None:
            tokenizer.save(staging)
        replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
