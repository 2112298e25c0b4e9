"""Load a local Hugging Face-format directory (Kimi-Linear or Kimi-K3) into a K3ForCausalLM.

The model is built on the meta device (no memory), then every checkpoint tensor is read on its own with
safetensors' safe_open, renamed and reshaped into its native place, and the finished tensors are attached
with load_state_dict(assign=True). Peak memory is the model plus one checkpoint tensor (plus, for MXFP4
experts, that tensor's dequantised copy), never a second copy of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from k3.checkpoint.hf_names import (
    FORMATS,
    INDEX_FILE,
    SINGLE_FILE,
    Piece,
    checkpoint_to_native,
    expert_names,
    is_stacked_expert,
    native_to_checkpoint,
    strip_prefix,
)
from k3.checkpoint.mxfp4 import dequantize_mxfp4
from k3.checkpoint.native import check_finite
from k3.config import ModelConfig
from k3.hf_config import K3_WRAPPER_TYPES, from_hf_config
from k3.model import K3ForCausalLM

# Kept in fp32 whatever dtype is asked for: tiny tensors whose precision decides routing ties and decay rates.
FP32_SUFFIXES = ("e_score_correction_bias", "A_log", "dt_bias")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# --- config -------------------------------------------------------------------------------------------------
def inside_directory(directory: Path, name: str, what: str) -> Path:
    """directory / name, refused (ValueError) when it lies outside the directory: an absolute path, '..', or a
    symlink out of it. A downloaded model directory must not make k3 read files elsewhere on the machine."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} names {name!r}, not a file name")
    path = directory / name
    root = directory.resolve()
    if os.path.isabs(name) or not path.resolve().is_relative_to(root):
        raise ValueError(f"{what} names {name!r}, which lies outside {directory} (an absolute path, '..' or a link "
                         f"out of it); k3 reads only files inside the model directory")
    return path


def read_hf_config(path: str | os.PathLike) -> tuple[ModelConfig, dict, str]:
    """(ModelConfig, the raw config.json dict, format 'kimi_linear' | 'kimi_k3') of an HF directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory; from_pretrained needs a local HF-format "
                                f"directory holding config.json and model.safetensors[.index.json]")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; an HF-format checkpoint directory needs one")
    inside_directory(directory, "config.json", str(directory))
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error})") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} holds a JSON {type(raw).__name__}; a model config is a JSON object "
                         f"({{\"model_type\": ..., ...}})")
    model_type = raw.get("model_type")
    fmt = "kimi_k3" if ("text_config" in raw or model_type in K3_WRAPPER_TYPES) else "kimi_linear"
    if fmt == "kimi_linear" and model_type not in ("kimi_linear", None):
        raise ValueError(f"{config_file}: unknown model_type {model_type!r}; k3 loads 'kimi_linear' checkpoints and "
                         f"the Kimi-K3 wrapper ({', '.join(repr(t) for t in K3_WRAPPER_TYPES)} with a text_config)")
    _check_supported(raw.get("text_config", raw), config_file)
    return from_hf_config(raw), raw, fmt


def _check_supported(text: dict, config_file: Path) -> None:
    """Refuse switches of the published configs that k3's model does not implement, instead of running wrong."""
    groups = text.get("num_expert_group", text.get("n_group")) or 1
    topk_groups = text.get("topk_group") or groups
    if groups > 1 and topk_groups < groups:
        raise ValueError(f"{config_file}: group-limited routing (num_expert_group={groups}, topk_group={topk_groups}) "
                         f"is not implemented in k3; only topk_group == num_expert_group (or 1 group) is supported")
    activation = text.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(f"{config_file}: moe_router_activation_func={activation!r} is not supported; k3's router "
                         f"uses 'sigmoid'")


# --- files --------------------------------------------------------------------------------------------------
def weight_map(path: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> file name (relative to the directory), from the index or the single file."""
    directory = Path(path)
    index = directory / INDEX_FILE
    if index.is_file():
        inside_directory(directory, INDEX_FILE, str(directory))
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a safetensors index (JSON with a 'weight_map' object): {error}") \
                from error
        if not isinstance(mapping, dict):
            raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
        for file in set(mapping.values()):
            inside_directory(directory, file, str(index))
        missing = sorted({f for f in mapping.values() if not (directory / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) missing from {directory}: {', '.join(missing)}; "
                                    f"copy the complete checkpoint (every file named in the index)")
        return dict(mapping)
    single = directory / SINGLE_FILE
    if single.is_file():
        inside_directory(directory, SINGLE_FILE, str(directory))
        with open_safetensors(single) as handle:
            return {name: SINGLE_FILE for name in handle.keys()}
    raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; an HF-format checkpoint "
                            f"stores its weights in one of them")


def open_safetensors(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {error}") from error


class _Shards:
    """Shard files opened on first use. They are memory-mapped, and the pages a read touches stay resident
    while the file is open, so `close()` is called after each shard to keep peak memory near the model size."""

    def __init__(self, directory: Path, mapping: dict[str, str]) -> None:
        self.directory, self.mapping = directory, mapping
        self.handles: dict[str, object] = {}
        self.names: dict[str, set[str]] = {}

    def __enter__(self) -> "_Shards":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def _handle(self, file: str):
        if file not in self.handles:
            self.handles[file] = open_safetensors(self.directory / file).__enter__()
        return self.handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.mapping[name]).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        file = self.mapping[name]
        handle = self._handle(file)
        if file not in self.names:
            self.names[file] = set(handle.keys())
        if name not in self.names[file]:
            raise ValueError(f"{self.directory / file} does not hold {name}, but the index says it does")
        try:
            return handle.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"{self.directory / file}: cannot read {name} ({error})") from error


# --- weights ------------------------------------------------------------------------------------------------
def _target_dtype(native_name: str, stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    if not stored.is_floating_point:
        return stored
    if dtype is None:
        return stored
    return torch.float32 if native_name.endswith(FP32_SUFFIXES) else dtype


class _Assembler:
    """Collects native tensors on `device`; stacked experts arrive one expert at a time."""

    def __init__(self, native_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype | None,
                 device: torch.device) -> None:
        self.shapes, self.dtype, self.device = native_shapes, dtype, device
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled: dict[str, set[int]] = {}
        self.origin: dict[str, str] = {}

    def put(self, piece: Piece, value: torch.Tensor, source_name: str, file: str) -> None:
        target = piece.target
        if target not in self.shapes:
            raise ValueError(f"{file}: {source_name} maps to {target}, which this config does not have")
        full = self.shapes[target]
        expected = full[1:] if piece.expert is not None else full
        if tuple(value.shape) != tuple(expected):
            if not (piece.reshape and value.numel() == _numel(expected)):
                raise ValueError(f"{file}: {source_name} has shape {tuple(value.shape)} but config.json implies "
                                 f"{tuple(expected)} for it; the weights do not belong to this config")
            value = value.reshape(expected)
        if target not in self.tensors:
            dtype = self.dtype_for(target, value.dtype)
            # Copied into a fresh allocation rather than kept as returned: measured, this keeps peak RSS lower
            # (safetensors' own buffers are released right after each tensor).
            self.tensors[target] = torch.empty(full, dtype=dtype, device=self.device)
            self.filled[target] = set()
        slot = -1 if piece.expert is None else piece.expert
        if piece.expert is not None and not 0 <= piece.expert < full[0]:
            raise ValueError(f"{file}: {source_name} is expert {piece.expert} but the config has {full[0]} experts")
        if slot in self.filled[target]:
            raise ValueError(f"{file}: {source_name} fills {target} a second time (first from "
                             f"{self.origin[target]}); the checkpoint holds the same tensor under two names")
        self.filled[target].add(slot)
        self.origin[target] = source_name
        destination = self.tensors[target] if piece.expert is None else self.tensors[target][piece.expert]
        destination.copy_(value)

    def dtype_for(self, target: str, stored: torch.dtype) -> torch.dtype:
        return _target_dtype(target, stored, self.dtype)

    def missing(self) -> list[str]:
        out = []
        for name, shape in self.shapes.items():
            done = self.filled.get(name, set())
            need = set(range(shape[0])) if is_stacked_expert(name) else {-1}
            if is_stacked_expert(name) and -1 in done:
                continue
            if not need <= done:
                out.append(name)
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _pieces_for(name: str, fmt: str, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                mapping: dict[str, str]) -> list[Piece] | None:
    """Pieces of one checkpoint tensor; None when it is skipped on purpose, [] when it is unknown."""
    stripped = strip_prefix(name, fmt)
    if stripped is None:
        return None
    if stripped.endswith(".weight_scale") and name[: -len("weight_scale")] + "weight_packed" in mapping:
        return None  # read together with its weight_packed sibling
    return checkpoint_to_native(stripped, config, shapes)


def _expected_names(native: str, config: ModelConfig, fmt: str) -> list[str]:
    prefix = "language_model." if fmt == "kimi_k3" else ""
    if is_stacked_expert(native):
        return [prefix + n for n in expert_names(native, config.num_experts, fmt, mxfp4=False)[:2]] + ["..."]
    return [prefix + native_to_checkpoint(native, fmt)]


def load_hf_weights(model: K3ForCausalLM, path: str | os.PathLike, fmt: str, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", progress: bool = True) -> K3ForCausalLM:
    """Fill a (meta-device) model from the safetensors files of an HF directory, tensor by tensor."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    directory = Path(path)
    mapping = weight_map(directory)
    config = model.config
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    assembler = _Assembler(shapes, dtype, torch.device(device))
    unknown: list[str] = []
    by_file: dict[str, list[str]] = {}
    for name, file in mapping.items():
        by_file.setdefault(file, []).append(name)
    # Each name parsed once: the expert check reads all of them before anything is loaded.
    pieces_of = {name: _pieces_for(name, fmt, config, shapes, mapping) for name in mapping}
    _check_expert_counts(pieces_of, shapes, directory)
    with _Shards(directory, mapping) as shards:
        for file in tqdm(sorted(by_file), desc="loading shards", unit="shard", disable=not progress):
            for name in sorted(by_file[file]):
                pieces = pieces_of[name]
                if pieces is None:
                    continue
                if not pieces:
                    unknown.append(name)
                    continue
                value = shards.read(name)
                if pieces[0].mxfp4:
                    value = _dequantize(name, value, shards, mapping, assembler.dtype_for(pieces[0].target,
                                                                                          torch.bfloat16))
                for piece in pieces:
                    part = value if piece.source is None else value.narrow(
                        piece.source_dim, piece.source.start, piece.source.stop - piece.source.start)
                    assembler.put(piece, part, name, str(directory / file))
                del value
            shards.close()
    if unknown:
        warnings.warn(f"{directory}: {len(unknown)} tensor(s) not used by the k3 model, e.g. {unknown[:5]}",
                      stacklevel=2)
    missing = assembler.missing()
    if missing:
        examples = "; ".join(f"{n} (stored as {', '.join(_expected_names(n, config, fmt))})" for n in missing[:5])
        raise ValueError(f"{directory} lacks {len(missing)} tensor(s) the config needs, e.g. {examples}")
    state = assembler.tensors
    check_finite(state, str(directory))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"after loading, {still_meta[:5]} are still unmaterialised (meta tensors)")
    return model


def _check_expert_counts(pieces_of: dict[str, list[Piece] | None], shapes: dict[str, tuple[int, ...]],
                         directory: Path) -> None:
    """Every stacked expert tensor [E, ...] must find its E experts among the checkpoint's names, checked from
    the names alone: the assembler allocates a stacked tensor at the config's E on its first expert, and a config
    that claims far more experts than the files hold (a stranger's config.json) would allocate that first."""
    present: dict[str, set[int]] = {}
    whole: set[str] = set()  # stored stacked, all experts in one tensor (its shape is checked before it is copied)
    for pieces in pieces_of.values():
        for piece in pieces or []:
            if piece.expert is not None:
                present.setdefault(piece.target, set()).add(piece.expert)
            elif is_stacked_expert(piece.target):
                whole.add(piece.target)
    for target, shape in shapes.items():
        if is_stacked_expert(target) and target not in whole and len(present.get(target, ())) < shape[0]:
            raise ValueError(f"{directory} holds {len(present.get(target, ()))} of the {shape[0]} experts "
                             f"config.json gives {target}; the weights do not belong to this config")


def _dequantize(name: str, packed: torch.Tensor, shards: _Shards, mapping: dict[str, str],
                dtype: torch.dtype) -> torch.Tensor:
    scale_name = name[: -len("weight_packed")] + "weight_scale"
    if scale_name not in mapping:
        raise ValueError(f"{name} is MXFP4-packed but its scales {scale_name} are not in the checkpoint")
    scale = shards.read(scale_name)
    try:
        return dequantize_mxfp4(packed, scale, dtype)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error


def _detect_a_log_size(config: ModelConfig, shards: _Shards, mapping: dict[str, str]) -> ModelConfig:
    """K3 stores A_log longer than the head count (e.g. [128] for 96 heads); size the native tensor to match,
    so that saving again writes the same tensor back."""
    for name in mapping:
        if name.endswith(("self_attn.A_log", "forget_gate.A_log")):
            size = _numel(shards.shape(name))
            if size != config.kda_num_heads and size != (config.kda_a_log_size or config.kda_num_heads):
                return dataclasses.replace(config, kda_a_log_size=size)
            return config
    return config


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu", progress: bool = True) -> K3ForCausalLM:
    """Load the model of a local HF-format directory (Kimi-Linear or Kimi-K3), in eval mode.

    dtype None keeps each tensor's stored dtype (MXFP4 experts become bf16); a dtype converts every floating
    tensor except A_log, dt_bias and the routing bias, which stay fp32. The tokenizer is loaded on its own,
    with `k3.load_tokenizer(path)`, as transformers' AutoTokenizer is."""
    dtype = parse_dtype(dtype)
    config, _, fmt = read_hf_config(path)
    mapping = weight_map(path)
    with _Shards(Path(path), mapping) as shards:
        config = _detect_a_log_size(config, shards, mapping)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    load_hf_weights(model, path, fmt, dtype, device, progress)
    return model.eval()
