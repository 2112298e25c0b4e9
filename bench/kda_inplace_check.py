"""KDA decode over a pool of state slots on one GPU: k3's in-place kernel against fla's out-of-place one.

Usage: python bench/kda_inplace_check.py [--batches 1 64] [--slots 80] [--tokens 1] [--iters 200] [--tol 1e-4]

At the `small` preset's KDA shapes (heads, head dim and gate from the config: H=8, dk=dv=128, lower bound -5),
bf16 q/k/v/gate/beta and an fp32 pool of --slots states, rows on unsorted distinct slots:
  old  what decode did before: gather the rows' states (index_select), fla's public fused_recurrent_kda with
       output_final_state, scatter the new states back (index_copy_): six times the state bytes;
  new  k3.ops.kda.fused_recurrent_kda_inplace: fla's fused_recurrent_kda_fwd reading each state from its slot
       and writing it back there (ssm_state_indices, inplace_final_state): twice.
Printed per batch: max |new - old| of o, of the updated slots, and of the untouched slots against their values
before the step (must be exactly 0); then ms per call of each path (CUDA events around --iters calls after
--warmup, the old path's gather and scatter included) and old / new. Exits 1 when a difference exceeds --tol,
2 when there is no CUDA device or fla (or fla lacks the in-place launcher).
"""

from __future__ import annotations

import argparse
import sys

import torch

from k3.config import ModelConfig
from k3.ops import kda as kda_ops
from k3.ops.kda import fused_recurrent_kda_inplace


def make_inputs(config: ModelConfig, batch: int, tokens: int, slots: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, dim = config.kda_num_heads, config.kda_head_dim

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    lower_bound = config.gate_lower_bound if config.kda_gate == "lower_bound" else None
    return dict(
        q=randn(batch, tokens, heads, dim), k=randn(batch, tokens, heads, dim), v=randn(batch, tokens, heads, dim),
        g=randn(batch, tokens, heads, dim), beta=randn(batch, tokens, heads),
        options=dict(use_gate_in_kernel=True, A_log=randn(heads, dtype=torch.float32, scale=0.5),
                     dt_bias=randn(heads * dim, dtype=torch.float32), use_beta_sigmoid_in_kernel=True,
                     lower_bound=lower_bound),
        pool=randn(slots, heads, dim, dim, dtype=torch.float32, scale=0.1),
        # Distinct (two rows on one slot would race) and unsorted, as an engine's rows are.
        indices=torch.randperm(slots, device="cuda", generator=gen)[:batch],
    )


def old_step(inputs: dict, pool: torch.Tensor) -> torch.Tensor:
    fla_recurrent = kda_ops._load_fla()[1]
    indices = inputs["indices"]
    o, final = fla_recurrent(q=inputs["q"], k=inputs["k"], v=inputs["v"], g=inputs["g"], beta=inputs["beta"],
                             initial_state=pool.index_select(0, indices), output_final_state=True,
                             use_qk_l2norm_in_kernel=True, **inputs["options"])
    pool.index_copy_(0, indices, final)
    return o


def new_step(inputs: dict, pool: torch.Tensor) -> torch.Tensor:
    return fused_recurrent_kda_inplace(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], pool,
                                       inputs["indices"], use_qk_l2norm_in_kernel=True, **inputs["options"])


def ms_per_call(step, inputs: dict, pool: torch.Tensor, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step(inputs, pool)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step(inputs, pool)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()  # NaN propagates and fails the tolerance


def check(config: ModelConfig, batch: int, args) -> dict:
    inputs = make_inputs(config, batch, args.tokens, args.slots, seed=args.seed + batch)
    before = inputs["pool"]
    old_pool, new_pool = before.clone(), before.clone()
    with torch.no_grad():
        o_old = old_step(inputs, old_pool)
        o_new = new_step(inputs, new_pool)
        torch.cuda.synchronize()
        named = inputs["indices"]
        untouched = torch.ones(args.slots, dtype=torch.bool, device="cuda")
        untouched[named] = False
        result = dict(
            batch=batch,
            o=max_abs(o_new, o_old),
            updated=max_abs(new_pool[named], old_pool[named]),
            untouched=max(max_abs(new_pool[untouched], before[untouched]),
                          max_abs(old_pool[untouched], before[untouched])),
            moved=max_abs(new_pool[named], before[named]),  # > 0: the step did write the named slots
        )
        result["old_ms"] = ms_per_call(old_step, inputs, old_pool, args.warmup, args.iters)
        result["new_ms"] = ms_per_call(new_step, inputs, new_pool, args.warmup, args.iters)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--slots", type=int, default=80)
    parser.add_argument("--tokens", type=int, default=1, help="new tokens per row (decode: 1)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    loaded = kda_ops._load_fla()
    if isinstance(loaded, str) or loaded[2] is None:
        reason = loaded if isinstance(loaded, str) else kda_ops.find_fla_inplace_fwd(sys.modules["fla.ops.kda"])
        print(f"needs fla with fused_recurrent_kda_fwd's in-place mode ({reason})")
        return 2
    kda_ops.set_kda_backend("fla")  # K3_KDA_BACKEND=torch would compare the PyTorch twin instead
    if any(b > args.slots for b in args.batches):
        print(f"every batch needs its own slot: --slots {args.slots} < max --batches {max(args.batches)}")
        return 2
    config = ModelConfig.from_preset("small")
    print(f"{torch.cuda.get_device_name()}; small preset KDA: H={config.kda_num_heads}, "
          f"dk=dv={config.kda_head_dim}, lower bound {config.gate_lower_bound}; pool of {args.slots} fp32 slots, "
          f"{args.tokens} token(s) per row, bf16 inputs; {args.iters} timed calls after {args.warmup}")
    failed = False
    header = (f"{'batch':>5}  {'max|do|':>9}  {'max|dS| upd':>11}  {'max|dS| other':>13}  {'moved':>7}  "
              f"{'old ms':>8}  {'new ms':>8}  {'old/new':>7}")
    print(header)
    for batch in args.batches:
        r = check(config, batch, args)
        bad = max(r["o"], r["updated"]) > args.tol or r["untouched"] != 0.0 or not r["moved"] > 0
        failed |= bad
        print(f"{batch:>5}  {r['o']:>9.2e}  {r['updated']:>11.2e}  {r['untouched']:>13.2e}  {r['moved']:>7.2e}  "
              f"{r['old_ms']:>8.4f}  {r['new_ms']:>8.4f}  {r['old_ms'] / r['new_ms']:>7.2f}"
              f"{'  FAIL' if bad else ''}")
    if failed:
        print(f"FAIL: a difference above {args.tol}, an untouched slot that changed, or a step that wrote nothing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
