"""KDA on GPU: k3's KDA op and layer against bare fla `chunk_kda` and fla's own KDA layer, in one run.

Usage: python bench/kda.py [--shapes 4x8192 1x65536] [--heads 32] [--dim 128] [--hidden 2048] [--out kda.json]

Rows per shape (B x T), forward (no grad) and forward+backward, median ms over repeats:
  fla chunk_kda (bare)  the kernel alone, gate and beta precomputed outside it: the baseline
  k3 chunk_kda op       k3.ops.kda.chunk_kda as the layer calls it: raw gate and beta logits, fused in-kernel
  fla KDA layer         fla.layers.KimiDeltaAttention (safe gate, lower bound -5), projections included
  k3 KDA layer          k3.layers.kda.KimiDeltaAttention at the same widths (low-rank output gate like fla's)
  k3 layer, unfused     the same with K3_FUSED_BACKEND=torch (PyTorch short conv and gated norm: the layer
                        before fla's fused kernels), for the before/after in one run
  k3 op keep / c32 / keep+c32   the op with fla's training options (k3.ops.kda.training_options): the forward's
                        intermediates kept for the backward (K3_KDA_KEEP_INTERMEDIATES=1), chunks of 32
                        (K3_KDA_CHUNK=32), both; with their peak memory. `small`'s shape: --shapes 4x4096 --heads 8
                        --hidden 1024
Ratios: op vs bare kernel, k3 layer vs fla layer ("layer overhead"), and each layer vs the bare kernel.
"""

from __future__ import annotations

import argparse

import torch

from common import device_name, print_table, reset_peak_memory, time_ms, write_json

from k3 import kernels
from k3.config import ModelConfig
from k3.layers.kda import KimiDeltaAttention
from k3.ops.fused_backend import set_fused_backend
from k3.ops.kda import chunk_kda, kda_backend, kda_gate, training_options

LOWER_BOUND = -5.0


def kernel_inputs(B: int, T: int, H: int, D: int, device) -> dict:
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16)  # noqa: E731
    A_log = torch.rand(H, device=device).mul(2).log1p()
    dt_bias = torch.randn(H * D, device=device) * 0.5
    raw_gate = make(B, T, H, D)
    return dict(q=make(B, T, H, D), k=make(B, T, H, D), v=make(B, T, H, D), raw_gate=raw_gate,
                beta_logits=make(B, T, H), A_log=A_log, dt_bias=dt_bias,
                g=kda_gate(raw_gate, A_log, dt_bias, LOWER_BOUND), beta=torch.sigmoid(make(B, T, H).float()).bfloat16())


def run_bare(fla_chunk, x: dict, backward: bool):
    leaves = [x[n].requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")]
    o, _ = fla_chunk(q=leaves[0], k=leaves[1], v=leaves[2], g=leaves[3], beta=leaves[4],
                     use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND)
    if backward:
        o.backward(torch.ones_like(o))


# The op's variants with fla's training options, as k3.ops.kda.training_options gives them under each switch.
OPTION_VARIANTS = {"op_keep": dict(kda_keep="1"), "op_c32": dict(kda_chunk="32"),
                   "op_keep_c32": dict(kda_keep="1", kda_chunk="32")}


def run_op(x: dict, backward: bool, options: dict | None = None):
    leaves = [x[n].requires_grad_(backward) for n in ("q", "k", "v", "raw_gate", "beta_logits")]
    o, _ = chunk_kda(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND,
                     safe_gate=True, use_beta_sigmoid_in_kernel=True, **(options or {}))
    if backward:
        o.backward(torch.ones_like(o))


def run_layer(layer, hidden: torch.Tensor, backward: bool, is_fla: bool, unfused: bool = False):
    set_fused_backend("torch" if unfused else None)
    try:
        out = layer(hidden)
    finally:
        set_fused_backend(None)
    out = out[0] if is_fla else out
    if backward:
        out.backward(torch.ones_like(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4x8192", "1x65536"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    from fla.layers import KimiDeltaAttention as FlaKDA
    from fla.ops.kda import chunk_kda as fla_chunk

    H, D = args.heads, args.dim
    torch.manual_seed(0)
    config = ModelConfig(hidden_size=args.hidden, kda_num_heads=H, kda_head_dim=D, kda_output_gate="low_rank",
                         gate_lower_bound=LOWER_BOUND, num_layers=1, full_attn_layers=[])
    ours = KimiDeltaAttention(config, 0).to(device, torch.bfloat16)
    ours.reset_gate_parameters()
    theirs = FlaKDA(hidden_size=args.hidden, head_dim=D, num_heads=H, safe_gate=True, lower_bound=LOWER_BOUND,
                    mode="chunk", layer_idx=0).to(device, torch.bfloat16)
    print(f"KDA bench on {device_name()}, H={H} d={D} hidden={args.hidden}, k3 KDA backend: "
          f"{kda_backend(torch.empty(1, device=device))}")
    rows, results = [], []
    for shape in args.shapes:
        B, T = (int(v) for v in shape.lower().split("x"))
        x = kernel_inputs(B, T, H, D, device)
        hidden = torch.randn(B, T, args.hidden, device=device, dtype=torch.bfloat16)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            hidden.requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                timings, peaks = {}, {}
                variants = [("bare", lambda: run_bare(fla_chunk, x, backward)),
                            ("op", lambda: run_op(x, backward)),
                            ("fla_layer", lambda: run_layer(theirs, hidden, backward, True)),
                            ("k3_layer", lambda: run_layer(ours, hidden, backward, False)),
                            ("k3_unfused", lambda: run_layer(ours, hidden, backward, False, True))]
                for name, switches in OPTION_VARIANTS.items():
                    with kernels.use(**switches):
                        options = training_options()
                    variants.append((name, lambda options=options: run_op(x, backward, options)))
                for name, fn in variants:
                    reset_peak_memory()
                    timings[name] = time_ms(fn, warmup=3, repeats=args.repeats)
                    peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            r = dict(B=B, T=T, mode=mode, **{f"{k}_ms": v for k, v in timings.items()},
                     **{f"{k}_peak_gib": v for k, v in peaks.items()},
                     op_overhead=timings["op"] / timings["bare"] - 1,
                     layer_overhead_vs_fla_layer=timings["k3_layer"] / timings["fla_layer"] - 1,
                     k3_layer_vs_bare=timings["k3_layer"] / timings["bare"],
                     fla_layer_vs_bare=timings["fla_layer"] / timings["bare"])
            results.append(r)
            rows.append([f"{B}x{T}", mode, timings["bare"], timings["op"], timings["fla_layer"], timings["k3_layer"],
                         timings["k3_unfused"], *(timings[name] for name in OPTION_VARIANTS),
                         *(f"{peaks[name] - peaks['op']:+.2f}" for name in OPTION_VARIANTS),
                         f"{100 * r['op_overhead']:+.1f}%", f"{100 * r['layer_overhead_vs_fla_layer']:+.1f}%",
                         f"{r['k3_layer_vs_bare']:.2f}x", f"{r['fla_layer_vs_bare']:.2f}x"])
            print(rows[-1], flush=True)
    print_table(f"KDA: k3 vs fla on {device_name()} (ms, median of {args.repeats})",
                ["BxT", "mode", "fla kernel", "k3 op", "fla layer", "k3 layer", "k3 unfused", "op keep", "op c32",
                 "op keep+c32", "keep GiB+", "c32 GiB+", "keep+c32 GiB+", "op ovh", "layer ovh vs fla layer",
                 "k3 layer/kernel", "fla layer/kernel"], rows)
    write_json(args.out, {"bench": "kda", "heads": H, "dim": D, "hidden": args.hidden, "results": results})


if __name__ == "__main__":
    main()
