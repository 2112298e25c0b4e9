"""fla's fused recurrent KDA kernel as a decode step runs it (one token, states advanced in place in their pool
slots), under the launch fla picks and under other value-block widths, warps and stages, against the bytes floor.

Usage: python bench/kda_recurrent.py [--batch 64 1] [--layers 12] [--out FILE]

Each KDA layer of a decode step reads its rows' fp32 states [H, K, V] and writes them back: at `small`'s 8 heads of
128 x 128 and batch 64 that is 33.6 MB each way, so the floor of the kernel is 2 x state bytes over the copy
bandwidth measured in the same run. fla 0.6.0 launches it with BV = 32 value columns per program, 4 warps and 2
stages, fixed, after zero-filling the output. k3 launches the same kernel itself (k3/ops/kda/fla_launch.py) with
the (BV, num_warps, num_stages) that K3_KDA_RECURRENT_LAUNCH names, or its own pick for the batch ("auto", the
default); "32,4,2" is fla's tile without fla's launcher. Outputs and states are checked against fla's launch before
timing (fp32 states to 1e-5, bf16 outputs to 1e-2 of their largest value: another tile sums over K in another
order). All layers
(distinct pools, so no layer finds its states in L2) run in one CUDA graph; the result is microseconds per layer.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

from common import device_name, graph_us_per_layer, kernel_bench_bandwidth, print_table, write_json

from k3.ops.kda import fused_recurrent_kda_inplace
from k3.ops.kda.fla_launch import auto_launch

HEADS, KEY, VALUE = 8, 128, 128  # `small`
ENV = "K3_KDA_RECURRENT_LAUNCH"
# fla's own launcher, k3's pick for the batch (k3.ops.kda.fla_launch.auto_launch), then (BV, num_warps,
# num_stages) launched by k3
LAUNCHES = ("fla", "auto", (32, 4, 2), (16, 4, 2), (64, 4, 2), (32, 2, 2), (32, 8, 2), (64, 8, 2), (16, 2, 2),
            (32, 4, 1), (128, 8, 2), (8, 1, 2), (16, 1, 2), (32, 1, 2), (64, 2, 2), (16, 2, 3), (8, 2, 2), (16, 1, 1),
            (8, 1, 1))


def launched_as(launch: str):
    """k3's in-place decode KDA under K3_KDA_RECURRENT_LAUNCH=launch: "fla" (fla's own launcher), "auto" (k3's
    pick) or "BV,warps,stages" (k3 launching fla's kernel so)."""
    return mock.patch.dict(os.environ, {ENV: launch})


def bench_batch(batch: int, layers: int, bandwidth: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    q, k = rand(batch, 1, HEADS, KEY), rand(batch, 1, HEADS, KEY)
    v, g, beta = rand(batch, 1, HEADS, VALUE), rand(batch, 1, HEADS, KEY), rand(batch, 1, HEADS)
    a_log, dt_bias = rand(HEADS, dtype=torch.float32), rand(HEADS * KEY, dtype=torch.float32)
    pools = [rand(batch + 1, HEADS, KEY, VALUE, dtype=torch.float32).mul_(0.1) for _ in range(layers)]
    indices = torch.arange(1, batch + 1, device="cuda", dtype=torch.int32)  # slot 0 stays untouched
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                   use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)

    def step(i):
        return fused_recurrent_kda_inplace(q, k, v, g, beta, pools[i], indices, **options)

    start = pools[0].clone()
    with launched_as("fla"):
        want_o = step(0)
    want_state = pools[0].clone()
    result = dict(batch=batch, launches={}, mismatches=[])
    state_bytes = batch * HEADS * KEY * VALUE * 4
    result["floor_us"] = 2 * state_bytes / bandwidth * 1e6
    for launch in LAUNCHES:
        launch = launch if isinstance(launch, str) else ",".join(map(str, launch))
        tile = auto_launch(batch) if launch == "auto" else launch.split(",")
        key = "fla's launch" if launch == "fla" else ("k3 auto " if launch == "auto" else "") + \
            "BV{} w{} s{}".format(*tile)
        with launched_as(launch), torch.no_grad():
            try:
                pools[0].copy_(start)
                o = step(0)
                # Another tile shape sums over K in another order: the fp32 states agree to rounding, and the
                # bf16 outputs to a unit or so of their last place.
                state_err = ((pools[0] - want_state).abs().max() / want_state.abs().max()).item()
                out_err = ((o.float() - want_o.float()).abs().max() / want_o.float().abs().max()).item()
                result.setdefault("state_rel_err", {})[key], result.setdefault("out_rel_err", {})[key] = \
                    state_err, out_err
                same = state_err <= 1e-5 and out_err <= 1e-2
                if not same:
                    result["mismatches"].append(key)
                result["launches"][key] = graph_us_per_layer(step, layers)
            except Exception as exc:  # a launch the compiler rejects (registers, shared memory): said, skipped
                print(f"  {key}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
        print(f"batch {batch} {key}: {result['launches'][key]:.1f} us per layer (from fla's launch: state "
              f"{state_err:.1e}, output {out_err:.1e}{'' if same else ': DIFFERENT'})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[64, 1])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/kda_recurrent.py (fla's kernel)", "cuda", wants_triton=True,
                                       cpu_smoke=False)
    with torch.no_grad():
        results = [bench_batch(b, args.layers, bandwidth) for b in args.batch]
    fla_launch = "fla's launch"
    rows = []
    for r in results:
        best = min(r["launches"], key=r["launches"].get)
        auto = next((key for key in r["launches"] if key.startswith("k3 auto")), fla_launch)
        rows.append([r["batch"], f"{r['launches'][fla_launch]:.1f}", f"{auto[8:]} {r['launches'][auto]:.1f}",
                     f"{best} {r['launches'][best]:.1f}",
                     f"{r['floor_us']:.1f}", f"{r['launches'][fla_launch] / r['floor_us']:.2f}x",
                     f"{r['launches'][best] / r['floor_us']:.2f}x", ", ".join(r["mismatches"]) or "none"])
    print_table("fla's fused recurrent KDA, one token, in place, per layer (one CUDA graph over all layers)",
                ["batch", "fla launch us", "k3 auto us", "best launch us", "floor us", "fla / floor", "best / floor",
                 "outputs differing"], rows)
    write_json(args.out, dict(device=device_name(), bandwidth_bytes_per_s=bandwidth, heads=HEADS, key=KEY,
                              value=VALUE, results=results))
    if any(r["mismatches"] for r in results):
        sys.exit("a relaunch changed the outputs or states")


if __name__ == "__main__":
    main()
