"""Is the compiled decode step exact? Its bf16 logits and the eager bf16 step's, each against the eager fp32 step.

Usage: python bench/decode_exactness.py [--preset small] [--prompt 512] [--no-latent-norm] [--out exactness.json]

Comparing compiled bf16 with eager bf16 alone cannot tell a compile bug from a model whose bf16 output moves
with any change of rounding (at random init, `small`'s normed latent MoE makes routing flip between bf16 and
fp32 in most layers). The fp32 eager step is the reference both are held to: a compile bug shows as the compiled
step standing far further from it than the eager bf16 step does. The fp32 reference runs every PyTorch twin
(the same switches as bench/gpu_check.py), so it is also the oracle the fast paths are held to.
"""

from __future__ import annotations

import argparse
import copy

import torch

from common import relative_error, write_json
from decode import prefill
from gpu_check import twins

from k3 import K3ForCausalLM, ModelConfig
from static_decode import CUDAGraphDecoder, StaticCache, compiled_decode_step, decode_step


@torch.no_grad()
def first_step(model, ids, first, compiled: bool, capacity: int) -> torch.Tensor:
    """Logits of the first decode step (token `first`) after prefilling `ids`; compiled: the compiled step,
    captured as a CUDA graph on CUDA (the engine's K3_COMPILE_DECODE path)."""
    hybrid, _ = prefill(model, ids)
    static = StaticCache.from_hybrid(model.config, hybrid, capacity=capacity)
    if not compiled:
        return decode_step(model, static, first).float()
    if ids.is_cuda:
        return CUDAGraphDecoder(model, static, compile=True).step(first).float()
    return compiled_decode_step()(model, static, first).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--no-latent-norm", action="store_true", help="moe_latent_norm=False (the ablation)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = ModelConfig.from_preset(args.preset, **({"moe_latent_norm": False} if args.no_latent_norm else {}))
    torch.manual_seed(0)
    with torch.device(args.device):
        fp32 = K3ForCausalLM(config).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt), device=args.device)
    capacity = args.prompt + 8
    first = ids[:, -1:]
    with twins(True):  # the reference is the plain PyTorch path in fp32 (fla has no fp32 kernels cached)
        ref = first_step(fp32, ids, first, False, capacity)
    eager = first_step(bf16, ids, first, False, capacity)
    compiled = first_step(bf16, ids, first, True, capacity)
    rows = {"eager bf16 vs eager fp32": relative_error(eager, ref),
            "compiled bf16 vs eager fp32": relative_error(compiled, ref),
            "compiled bf16 vs eager bf16": relative_error(compiled, eager)}
    for name, value in rows.items():
        print(f"{name:32s} ||d|| / ||ref|| = {value:.4g}", flush=True)
    write_json(args.out, {"preset": args.preset, "prompt": args.prompt, "moe_latent_norm": config.moe_latent_norm,
                          "relative_errors": rows})


if __name__ == "__main__":
    main()
