"""MoonViT tower throughput on one GPU: images/s of the full-size K3 and Kimi-K2.5 towers (+ projector), bf16,
at 448x448 and 896x896, with flash varlen attention (cu_seqlens, one call per layer) against the per-image SDPA
loop measured in the same run.

Usage: python bench/vision.py [--sizes 448 896] [--variants k3 kimi-k2.5] [--out bench/results/vision_h200.json]

Each case packs `--patches` patches' worth of images (at least one image) into one forward (no grad). FLOPs per
image count the matmuls (2 x weights per patch, merged token for the projector) and attention (4 x L x QKV
width per patch per layer, L = the image's patch count).
"""

from __future__ import annotations

import argparse

import torch

from common import device_name, print_table, relative_error, time_ms, write_json

from k3.vision import VisionConfig, VisionModel


def flops_per_image(config: VisionConfig, side_patches: int) -> float:
    patches = side_patches * side_patches
    block = (config.hidden_size * 3 * config.qkv_width + config.qkv_width * config.hidden_size
             + 2 * config.hidden_size * config.intermediate_size)
    tower = 2 * patches * (config.num_layers * block + 3 * config.patch_size ** 2 * config.hidden_size)
    attention = config.num_layers * 4 * patches * patches * config.qkv_width
    merged = config.merged_width
    projector = 2 * (patches // config.merge_area) * (merged * merged + merged * config.text_hidden_size)
    return float(tower + attention + projector)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[448, 896])
    parser.add_argument("--variants", nargs="+", default=["k3", "kimi-k2.5"])
    parser.add_argument("--patches", type=int, default=32768, help="patches per forward (images packed)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each varlen case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/vision.py needs a CUDA device")
    torch.manual_seed(0)
    rows, results = [], []
    for variant in args.variants:
        config = VisionConfig.from_preset(variant)
        model = VisionModel(config).to("cuda", torch.bfloat16).eval()
        for size in args.sizes:
            side = size // config.patch_size
            images = max(1, args.patches // (side * side))
            grid = torch.tensor([[1, side, side]] * images)
            pixels = torch.randn(images * side * side, 3, config.patch_size, config.patch_size, device="cuda",
                                 dtype=torch.bfloat16)
            case = {"variant": variant, "size": size, "images_per_forward": images,
                    "tokens_per_image": side * side // config.merge_area}
            outputs = {}
            for backend in ("varlen", "sdpa"):
                model.attention_backend = backend
                with torch.no_grad():
                    outputs[backend] = model(pixels, grid)
                    ms = time_ms(lambda: model(pixels, grid), warmup=2, repeats=5)
                case[f"{backend}_ms"] = ms
                case[f"{backend}_images_per_s"] = images / ms * 1e3
                case[f"{backend}_tflops"] = flops_per_image(config, side) * images / ms / 1e9
            case["varlen_vs_sdpa_rel_err"] = relative_error(outputs["varlen"], outputs["sdpa"])
            if args.profile:
                model.attention_backend = "varlen"
                activities = [torch.profiler.ProfilerActivity.CUDA]
                with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
                    model(pixels, grid)
                print(f"\n# {variant} {size}x{size} varlen: top CUDA kernels")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
            case["speedup"] = case["sdpa_ms"] / case["varlen_ms"]
            results.append(case)
            rows.append([variant, f"{size}x{size}", images, case["varlen_images_per_s"], case["sdpa_images_per_s"],
                         case["speedup"], case["varlen_tflops"], case["varlen_vs_sdpa_rel_err"]])
        model.to("cpu")  # free the GPU for the next variant
        torch.cuda.empty_cache()
    print_table(f"MoonViT tower + projector, bf16, {device_name()}",
                ["variant", "image", "images/fwd", "varlen img/s", "sdpa img/s", "speedup", "varlen TFLOP/s",
                 "rel err"], rows)
    write_json(args.out, {"benchmark": "vision", "cases": results})


if __name__ == "__main__":
    main()
