"""CPU stand-ins for fla's kernels (the PyTorch twins behind fla's signatures and output layouts), installed as
fake `fla` modules so that k3.ops imports them the way it imports fla and the fla branch of every dispatch runs
on CPU: the k3:: custom ops, their fakes and the way a compiled step routes through them can then be checked
without a GPU. Like fla's entry points (input_guard), each stand-in is a closure, which dynamo can guard only
when it was reached through a module attribute."""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch.nn.functional as F

import k3.ops.kda as kda_ops
import k3.ops.norm as norm_ops
import k3.ops.short_conv as conv_ops
from k3.ops.kda.chunk import chunk_kda_torch
from k3.ops.kda.recurrent import fused_recurrent_kda_torch


def _guarded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@_guarded
def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, cu_seqlens=None, **kwargs):
    """fla's causal_conv1d convention: window state [N, C, W] in, (y, final window) out."""
    assert bias is None and residual is None and cu_seqlens is None and activation == "silu"
    tail = None if initial_state is None else initial_state[:, :, 1:].transpose(1, 2)
    y, new_tail = conv_ops.short_conv_torch(x, weight, tail)
    final = F.pad(new_tail.transpose(1, 2), (1, 0)).contiguous() if output_final_state else None
    return y.contiguous(), final


@_guarded
def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    assert bias is None and residual is None and not prenorm
    return norm_ops.rms_norm_torch(x, weight, eps)


@_guarded
def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    assert bias is None and residual is None and not prenorm and activation == "sigmoid"
    return norm_ops.rms_norm_gated_torch(x, g, weight, eps)


MODULES = {
    "fla.modules.causal_conv1d": dict(causal_conv1d=causal_conv1d),
    "fla.modules.norm.layernorm": dict(rms_norm=rms_norm),
    "fla.modules.norm.fused_norm_gate": dict(rms_norm_gated=rms_norm_gated),
    "fla.ops.kda": dict(chunk_kda=_guarded(chunk_kda_torch), fused_recurrent_kda=_guarded(fused_recurrent_kda_torch)),
}
LOADERS = (conv_ops._load_fla_conv, norm_ops._load_fla_norms, kda_ops._load_fla)


@contextlib.contextmanager
def installed(monkeypatch, configured: str = "fla"):
    """Every k3.ops dispatch takes its fla branch (the CUDA checks waived), with the stand-ins above as fla.
    `configured` is what K3_FUSED_BACKEND would say: "fla" (forced) or "auto", which lets a compiled decode step
    take the PyTorch twins Inductor fuses (k3.ops.norm)."""
    for name in ("fla", "fla.modules", "fla.modules.norm", "fla.ops", *MODULES):
        module = types.ModuleType(name)
        for attr, value in MODULES.get(name, {}).items():
            setattr(module, attr, value)
        monkeypatch.setitem(sys.modules, name, module)
    def fla(x=None, available=True):
        return configured if x is None else "fla" if available else "torch"

    monkeypatch.setattr(conv_ops, "fused_backend", fla)
    monkeypatch.setattr(norm_ops, "fused_backend", fla)
    monkeypatch.setattr(kda_ops, "_use_fla", lambda x: kda_ops._fla_available())
    for loader in LOADERS:
        loader.cache_clear()
    try:
        assert not any(isinstance(loader(), str) for loader in LOADERS)
        yield
    finally:
        for loader in LOADERS:
            loader.cache_clear()
