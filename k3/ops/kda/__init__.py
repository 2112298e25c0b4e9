"""Kimi Delta Attention (KDA) ops with fla's calling convention, dispatched to fla on CUDA or to PyTorch.

Decode over a pool of state slots: `fused_recurrent_kda_inplace` advances pool[indices[i]] where it lies
(k3/ops/kda/inplace.py).

Backend choice: `set_kda_backend(name)` if called (None resets), else the env var K3_KDA_BACKEND, else "auto".
  auto  - fla's Triton kernels for CUDA tensors when `fla.ops.kda` imports, the PyTorch paths otherwise;
  torch - always the PyTorch paths (k3/ops/kda/chunk.py, recurrent.py);
  fla   - always fla; a RuntimeError says why when it cannot run.
"""

from __future__ import annotations

import functools
import importlib

import torch

from k3 import kernels
from k3.ops.compile_constant import assume_constant_result
from k3.ops.fused_backend import opaque_under_compile
from k3.ops.kda.chunk import chunk_kda_torch
from k3.ops.kda.fla_launch import InplaceRecurrentLauncher, find_fla_recurrent_kernel
from k3.ops.kda.inplace import (check_state_pool, find_fla_inplace_fwd, fused_recurrent_kda_inplace_fla,
                                fused_recurrent_kda_inplace_torch)
from k3.ops.kda.naive import naive_recurrent_kda
from k3.ops.kda.recurrent import fused_recurrent_kda_torch
from k3.ops.kda.utils import check_inputs, kda_gate

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_recurrent_kda_inplace",
    "naive_recurrent_kda",
    "kda_gate",
    "set_kda_backend",
    "kda_backend",
    "training_options",
]

_ENV = kernels.SWITCHES["kda"].env


@functools.lru_cache(maxsize=1)
def _load_fla() -> tuple[object, object, object | None] | str:
    """fla's (chunk_kda, fused_recurrent_kda, the in-place decode launcher or None where fla has no in-place
    mode), or the import error as text. The launcher is k3's (k3/ops/kda/fla_launch.py) around fla's kernel
    where that kernel takes k3's arguments, else fla's fused_recurrent_kda_fwd. Imported once, lazily (pulls
    triton); one cache, so that whatever replaces fla (tests' CPU stand-ins) replaces all three together."""
    try:
        fla_kda = importlib.import_module("fla.ops.kda")
        fla_chunk, fla_recurrent = fla_kda.chunk_kda, fla_kda.fused_recurrent_kda
    except Exception as exc:  # a broken triton install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    inplace = find_fla_inplace_fwd(fla_kda)
    if isinstance(inplace, str):
        return fla_chunk, fla_recurrent, None
    kernel = find_fla_recurrent_kernel(fla_kda)
    return fla_chunk, fla_recurrent, inplace if isinstance(kernel, str) else InplaceRecurrentLauncher(inplace, kernel)


@assume_constant_result
def _fla_available() -> bool:
    """A constant to torch.compile: traced, the import would break the graph wherever fla is missing."""
    return not isinstance(_load_fla(), str)


@assume_constant_result
def _fla_inplace_available() -> bool:
    return _fla_available() and _load_fla()[2] is not None


def set_kda_backend(name: str | None) -> None:
    """Pin the KDA backend (k3.kernels.pin): "auto", "torch" or "fla"; None goes back to K3_KDA_BACKEND (default
    "auto")."""
    if name is not None and kernels.switch("kda").canonical(name, "set_kda_backend(name)") == "fla" \
            and isinstance(_load_fla(), str):
        raise RuntimeError(f"KDA backend 'fla' requested but fla is not importable ({_load_fla()}); "
                           "install flash-linear-attention>=0.6.0 or use 'torch'")
    kernels.pin("kda", name)


def kda_backend(x: torch.Tensor | None = None) -> str:
    """Without x: the configured backend ("auto", "torch" or "fla").

    With x (any input tensor): the implementation a call on x would run, "fla" or "torch".
    """
    name = kernels.choice("kda")
    if x is None or name != "auto":
        return name
    return "fla" if x.is_cuda and _fla_available() else "torch"


def _use_fla(x: torch.Tensor) -> bool:
    """Whether a call on x runs fla; raises when fla is forced but cannot run. (The kernels themselves are
    looked up only where they are called: a function handed back into a torch.compile trace as a constant
    cannot be guarded.)"""
    if kda_backend(x) != "fla":
        return False
    if not _fla_available():
        raise RuntimeError(f"KDA backend 'fla' forced but fla is not importable ({_load_fla()}); "
                           f"install flash-linear-attention>=0.6.0 or set {_ENV}=torch")
    if not x.is_cuda:
        raise RuntimeError(f"KDA backend 'fla' forced but the inputs are on {x.device}; fla's kernels need CUDA "
                           f"tensors (set {_ENV}=auto or torch for other devices)")
    return True


def training_options() -> dict:
    """fla keywords for a chunked KDA call that autograd will differentiate: keep the forward's intermediates for
    the backward (fla's disable_recompute; K3_KDA_KEEP_INTERMEDIATES=1) where fla would recompute them (the gate's
    cumsum, w and u, the chunk states h), and the chunk length (K3_KDA_CHUNK; fla takes 32 or 64). Neither changes
    the result, so the PyTorch twins accept and ignore them (k3.ops.kda.utils)."""
    options = {}
    if kernels.enabled("kda_keep"):
        options["disable_recompute"] = True
    chunk = int(kernels.choice("kda_chunk"))
    if chunk != 64:
        options["chunk_size"] = chunk
    return options


# fla's keyword options that the custom ops below carry; a call with any other keyword takes fla directly.
_OP_KWARGS = frozenset({"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "lower_bound",
                        "safe_gate"})


def _opaque(q, k, v, g, beta, initial_state, kwargs) -> bool:
    return set(kwargs) <= _OP_KWARGS and opaque_under_compile(q, k, v, g, beta, initial_state,
                                                              kwargs.get("A_log"), kwargs.get("dt_bias"))


def _dispatch(index: int, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              cu_seqlens, kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run entry point `index` (0 chunk_kda, 1 fused_recurrent_kda) on fla (as its custom op where the call is
    opaque under torch.compile) or on its PyTorch path."""
    fla = _use_fla(q)
    if fla and _opaque(q, k, v, g, beta, initial_state, kwargs):
        op = (fla_chunk_kda_op, fla_fused_recurrent_kda_op)[index]
        o, final = op(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      kwargs.get("use_gate_in_kernel", False), kwargs.get("A_log"), kwargs.get("dt_bias"),
                      kwargs.get("use_beta_sigmoid_in_kernel", False), kwargs.get("lower_bound"),
                      kwargs.get("safe_gate", False), cu_seqlens)
        return o, final if output_final_state else None
    impl = _load_fla()[index] if fla else (chunk_kda_torch, fused_recurrent_kda_torch)[index]
    return impl(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, **kwargs)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA for training and prefill (fla `chunk_kda` convention).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: log decay [B, T, H, K] (<= 0); beta: [B, T, H];
    scale: defaults to K**-0.5; initial_state: fp32 [N, H, K, V] with N = B, or N = number of sequences when
    cu_seqlens [N+1] (int64 offsets) packs variable-length sequences into B = 1.
    use_qk_l2norm_in_kernel: L2-normalise q and k over K (eps 1e-6) inside the op, gradients included.
    Returns o [B, T, H, V] in v's dtype and the fp32 final state [N, H, K, V] (None unless output_final_state).
    fla's in-kernel gate/beta keywords (use_gate_in_kernel, A_log, dt_bias, lower_bound,
    use_beta_sigmoid_in_kernel) are honoured by both backends.
    """
    return _dispatch(0, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu_seqlens, kwargs)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA for decode (fla `fused_recurrent_kda` convention); same arguments and shapes as chunk_kda.

    Pass everything after beta by keyword when code may also run against fla directly: fla's own signature puts
    A_log and dt_bias right after beta.
    """
    return _dispatch(1, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu_seqlens, kwargs)


# fla's two KDA entry points as custom ops, for torch.compile without autograd (a compiled decode step): dynamo
# cannot trace fla's launchers, and an op is one opaque call inside one graph. Same arguments as above (fla's
# in-kernel options spelled out); returns (o [B, T, HV, V], final state fp32 [N, HV, K, V], or an empty
# tensor when output_final_state is False: an op cannot return None).
def _fla_op_body(index: int, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, lower_bound, safe_gate,
                 cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = _load_fla()[index](q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                  use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
                                  safe_gate=safe_gate)
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)


def _fla_op_fake(o_dtype, q, k, v, cu_seqlens, output_final_state) -> tuple[torch.Tensor, torch.Tensor]:
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_shape = (sequences, v.shape[2], k.shape[-1], v.shape[-1]) if output_final_state else (0,)
    return v.new_empty(v.shape, dtype=o_dtype), q.new_empty(final_shape, dtype=torch.float32)


@torch.library.custom_op("k3::fla_chunk_kda", mutates_args=())
def fla_chunk_kda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                     use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, A_log: torch.Tensor | None,
                     dt_bias: torch.Tensor | None, use_beta_sigmoid_in_kernel: bool, lower_bound: float | None,
                     safe_gate: bool, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fla_op_body(0, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, lower_bound, safe_gate,
                        cu_seqlens)


@fla_chunk_kda_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, *rest):
    return _fla_op_fake(q.dtype, q, k, v, rest[-1], output_final_state)  # fla's chunk_kda: o.type_as(q)


@torch.library.custom_op("k3::fla_fused_recurrent_kda", mutates_args=())
def fla_fused_recurrent_kda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None, initial_state: torch.Tensor | None,
                               output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                               A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                               use_beta_sigmoid_in_kernel: bool, lower_bound: float | None, safe_gate: bool,
                               cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fla_op_body(1, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, lower_bound, safe_gate,
                        cu_seqlens)


@fla_fused_recurrent_kda_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, *rest):
    return _fla_op_fake(v.dtype, q, k, v, rest[-1], output_final_state)  # fla: o = zeros_like(v)


def fused_recurrent_kda_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    lower_bound: float | None = None,
    safe_gate: bool = False,
) -> torch.Tensor:
    """Decode KDA whose states stay in a pool: row i starts from state_pool[state_indices[i]] and its final
    state is written back there, in place; slots no row names are untouched. Inference only (no autograd).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state_pool: fp32 [S, H, K, V], each slot a
    contiguous [H, K, V] block; state_indices: int32/int64 [B], distinct, each in [0, S) (fla does not check:
    an index outside the pool makes its kernel read and write outside it; the PyTorch twin raises).
    Options as in fused_recurrent_kda (safe_gate only steers fla's chunked kernel and is accepted for drop-in
    use). Returns o [B, T, H, V] in v's dtype. On CUDA with fla: for T = 1 (decode) one kernel reading and
    writing each state once; for T > 1 fla's out-of-place kernel between a gather and a scatter of the states.
    """
    check_inputs(q, k, v, g, beta, None, None)
    check_state_pool(q, v, state_pool, state_indices)
    options = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound)
    if not _use_fla(q):
        return fused_recurrent_kda_inplace_torch(q, k, v, g, beta, state_pool, state_indices, scale,
                                                 use_qk_l2norm_in_kernel, **options)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias)):
        raise RuntimeError("fused_recurrent_kda_inplace has no backward on fla's kernel; train through "
                           "fused_recurrent_kda / chunk_kda (HybridCache), or run decode under torch.no_grad()")
    if not _fla_inplace_available() or q.shape[1] > 1:
        # Its out-of-place kernel between a gather and a scatter: where fla lacks the in-place launcher, and for
        # several tokens a row (a short prefill chunk), where the in-place kernel (fla 0.6.0's, as k3 launches it,
        # one state index per token) hung (3 rows of 11-14 tokens, the tiny preset) or gave other tokens (6 rows of
        # 2-12) inside the engine on one H100.
        rows = state_indices.long()  # index_copy_ takes int64 only
        o, final = fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=state_pool.index_select(0, rows),
                                       output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                       safe_gate=safe_gate, **options)
        state_pool.index_copy_(0, rows, final)
        return o
    if opaque_under_compile(q, k, v, g, beta, state_pool, A_log, dt_bias):
        # Inductor hands a custom op the strides it traced, and fla's launcher wants q, k, v, g, beta contiguous:
        # made so inside the op's body, each is an aten copy at every replay (q, k and v are slices of the joined
        # conv output, beta a column slice of the fused input GEMM: 4 copies per KDA layer in a batch-64 step).
        # Made so here, Inductor writes them contiguous from the kernels that produce them.
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        return fla_fused_recurrent_kda_inplace_op(q, k, v, g, beta, state_pool, state_indices, scale,
                                                  use_qk_l2norm_in_kernel, **options)
    return fused_recurrent_kda_inplace_fla(_load_fla()[2], q, k, v, g, beta, state_pool, state_indices, scale,
                                           use_qk_l2norm_in_kernel, **options)


# The in-place kernel as a custom op for torch.compile: opaque to dynamo like the ops above, and declared to
# write state_pool so that functionalisation orders the pool's readers after it (Inductor then hands the pool
# itself to the op, a view of the cache's buffer included, instead of a copy).
@torch.library.custom_op("k3::fla_fused_recurrent_kda_inplace", mutates_args=("state_pool",))
def fla_fused_recurrent_kda_inplace_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                       beta: torch.Tensor, state_pool: torch.Tensor, state_indices: torch.Tensor,
                                       scale: float | None, use_qk_l2norm_in_kernel: bool,
                                       use_gate_in_kernel: bool, A_log: torch.Tensor | None,
                                       dt_bias: torch.Tensor | None, use_beta_sigmoid_in_kernel: bool,
                                       lower_bound: float | None) -> torch.Tensor:
    return fused_recurrent_kda_inplace_fla(_load_fla()[2], q, k, v, g, beta, state_pool, state_indices, scale,
                                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                           use_beta_sigmoid_in_kernel, lower_bound)


@fla_fused_recurrent_kda_inplace_op.register_fake
def _(q, k, v, *rest):
    return v.new_empty(v.shape)  # fla: o = zeros_like(v) of a contiguous v
