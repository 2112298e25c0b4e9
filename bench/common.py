"""Shared helpers of the GPU benchmarks: timing with CUDA events, tables with ratios, FLOP counts, JSON results.

Every benchmark measures its baseline in the same process on the same device and prints ratios against it.
Results go to stdout as a table and, with --out, to a JSON file written atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from k3 import kernels
from k3.ops.triton_support import limit_triton_autotune_from_env

limit_triton_autotune_from_env()  # before anything imports fla (see there)

# Dense bf16 peak of one H200 SXM (vendor datasheet); MFU is reported against it.
H200_BF16_PEAK_FLOPS = 989e12


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], warmup: int = 2, repeats: int = 5) -> float:
    """Median milliseconds of fn() over `repeats` timed calls after `warmup` untimed ones.
    On CUDA each call is bracketed by events; on CPU by the wall clock."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_choices(text: str) -> dict[str, str]:
    """`moe=torch,glu=triton` -> {"moe": "torch", "glu": "triton"}, checked against k3.kernels (argparse type)."""
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"takes NAME=CHOICE pairs joined by commas (say moe=torch,glu=triton), "
                                         f"got {text!r}")
    try:
        return kernels.checked({name.strip(): choice.strip() for name, choice in pairs})
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_kernels_argument(parser) -> None:
    """--kernels NAME=CHOICE,...: k3.kernels choices the bench runs under (`k3 info --kernels` lists them)."""
    parser.add_argument("--kernels", type=kernel_choices, default={},
                        help="kernel switches for the whole run, NAME=CHOICE,... (k3 info --kernels lists them)")


def peak_memory_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it can never pass a tolerance."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def print_table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    """A fixed-width text table; floats get 3 significant decimals."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n## {title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write the payload (plus device and torch version) as JSON, atomically (k3's checkpoint writer)."""
    if not path:
        return
    from k3.atomic import atomic_write_bytes

    payload = {"device": device_name(), "torch": torch.__version__, **payload}
    atomic_write_bytes(path, json.dumps(payload, indent=2, default=str).encode())


def k3_train_flops_per_token(config, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3x forward) of a K3ForCausalLM config.

    6 * active parameters (input embedding excluded, LM head included) for the matmuls, plus causal MLA
    attention (QK^T and PV over seq_len/2 keys on average) and the KDA chunked recurrence, counted as a
    state read-and-write per token per head (4 * dk * dv multiply-adds for decay, delta rule and output)."""
    from k3.model import count_parameters

    active = count_parameters(config)["active_params"]
    mla_layers = config.layer_types.count("mla")
    kda_layers = config.layer_types.count("kda")
    attention = 2 * 2 * config.mla_num_heads * (config.qk_head_dim + config.v_head_dim) / 2 * seq_len / 2
    recurrence = 2 * 4 * config.kda_num_heads * config.kda_head_dim * config.kda_head_dim
    return 6 * active + 3 * (mla_layers * attention + kda_layers * recurrence)


def hf_train_flops_per_token(model, seq_len: int, num_mla: int, mla_heads: int, qk_dim: int, v_dim: int,
                             num_kda: int, kda_heads: int, kda_dim: int, experts: int, top_k: int) -> float:
    """Same count for a transformers Kimi-Linear model: 6 * active parameters + attention + recurrence."""
    total = embedding = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "embed_tokens" in name:
            embedding += p.numel()
        elif ".experts." in name:
            routed += p.numel()
    active = total - embedding - routed * (1 - top_k / experts)
    attention = 2 * 2 * mla_heads * (qk_dim + v_dim) / 2 * seq_len / 2
    recurrence = 2 * 4 * kda_heads * kda_dim * kda_dim
    return 6 * active + 3 * (num_mla * attention + num_kda * recurrence)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) on the current CUDA device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, repeats=10)
    return 2 * nbytes / (ms / 1e3)


def cpu_copy_bandwidth(nbytes: int = 1 << 26) -> float:
    """Host memory copy bandwidth (bytes read + written per second): the floor of a CPU smoke run."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), warmup=1, repeats=5) / 1e3)


def kernel_bench_bandwidth(script: str, device: str, wants_triton: bool, cpu_smoke: bool = True) -> float:
    """A kernel bench's start: exits with the reason when `device` cannot run it (CUDA missing; Triton on the CPU
    without its interpreter), else measures the copy bandwidth its floors use, prints it and returns it.
    `cpu_smoke`: whether the script offers `--device cpu` (said in the exit message)."""
    import sys

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA device" + (" (or --device cpu for a smoke test)" if cpu_smoke else ""))
    if device == "cpu" and wants_triton and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("the Triton path on CPU needs TRITON_INTERPRET=1")
    bandwidth = copy_bandwidth() if device == "cuda" else cpu_copy_bandwidth()
    print(f"{device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    return bandwidth


def graph_us_per_layer(run_layer, layers: int) -> float:
    """Median microseconds per layer of one CUDA-graph replay that runs `run_layer(i)` for every layer (distinct
    weights per layer, so that no layer finds its bytes in L2 from the one before)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):  # warm-up outside the graph (Triton compiles here)
            run_layer(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            run_layer(i)
    us = time_ms(graph.replay, warmup=3, repeats=20) * 1e3 / layers
    del graph
    return us


def write_kernel_sources(run, path: str) -> None:
    """One call of `run` (for a graphed step: the same compiled or eager function its CUDA graph captured) under
    the profiler with input shapes: for each device kernel, the op that launched it (an aten op such as mm with its
    shapes for cuBLAS kernels, a k3:: custom op, or Inductor's kernel launch). Tells which projection a cuBLAS
    kernel of the replay's table is. Printed and skipped on any failure: the timing does not depend on it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from k3.atomic import atomic_write_bytes

    try:
        synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run()
            synchronize()
        rows: dict[tuple[str, str, str], list[float]] = {}
        for event in prof.events():
            if event.device_type != DeviceType.CPU or not event.kernels:
                continue
            for kernel in event.kernels:
                key = (kernel.name[:100], event.name[:60], str(event.input_shapes)[:160])
                rows.setdefault(key, []).append(kernel.duration)
        lines = [f"{'launches':>8} {'total us':>9}  kernel  <-  launching op  input shapes"]
        for (kernel, op, shapes), times in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"{len(times):8d} {sum(times):9.1f}  {kernel}  <-  {op}  {shapes}")
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
        print(f"  kernels and the ops that launched them (one uncaptured call): {path}", flush=True)
    except Exception as exc:  # noqa: BLE001 (a profiler quirk must not cost the run)
        print(f"  kernel sources not written: {type(exc).__name__}: {exc}", flush=True)
