"""MXFP4 (OCP microscaling FP4) as stored by compressed-tensors' `mxfp4-pack-quantized` format.

A weight W [out, in] is cut into groups of 32 consecutive inputs. Each group shares one E8M0 scale byte s
(value 2^(s-127)); each element is a 4-bit E2M1 code (bit 3 sign, bits 2..1 exponent, bit 0 mantissa):

    code & 7 :   0    1    2    3    4    5    6    7
    |value|  :   0   0.5   1   1.5   2    3    4    6

Storage: `weight_packed` uint8 [out, in/2], two codes per byte, the LOW nibble holds the even column;
`weight_scale` uint8 [out, in/32]. Dequantised value = e2m1(code) * 2^(s - 127).

Quantisation follows the OCP rule: the shared exponent is floor(log2(amax)) - 2 (2 = the largest E2M1
exponent), elements are rounded to the nearest E2M1 value (ties to the even code) and saturate at +-6.
Dequantising then quantising again returns the same values, so a second round trip is exact.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_MAX_EXPONENT = 2


def _check_pair(packed_OH: torch.Tensor, scale_OG: torch.Tensor) -> None:
    if packed_OH.dtype != torch.uint8 or scale_OG.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed and weight_scale must be uint8, got {packed_OH.dtype} and "
                         f"{scale_OG.dtype}")
    if packed_OH.dim() != 2 or scale_OG.dim() != 2 or packed_OH.shape[0] != scale_OG.shape[0]:
        raise ValueError(f"MXFP4 weight_packed [out, in/2] and weight_scale [out, in/32] must be 2-D with the same "
                         f"rows, got {tuple(packed_OH.shape)} and {tuple(scale_OG.shape)}")
    if packed_OH.shape[1] * 2 != scale_OG.shape[1] * GROUP_SIZE:
        raise ValueError(f"MXFP4 weight_packed {tuple(packed_OH.shape)} holds {packed_OH.shape[1] * 2} inputs per row "
                         f"but weight_scale {tuple(scale_OG.shape)} covers {scale_OG.shape[1] * GROUP_SIZE} "
                         f"(groups of {GROUP_SIZE})")


def dequantize_mxfp4(packed_OH: torch.Tensor, scale_OG: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight_packed uint8 [O, I/2] + weight_scale uint8 [O, I/32] -> weight [O, I] in `dtype`.

    Every MXFP4 value is exactly representable in bf16/fp32 (2 significant bits times a power of two),
    so the result does not depend on rounding."""
    _check_pair(packed_OH, scale_OG)
    rows = packed_OH.shape[0]
    codes_OI = torch.stack([packed_OH & 0x0F, packed_OH >> 4], dim=-1).reshape(rows, -1)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed_OH.device)
    magnitude = table[(codes_OI & 7).long()]
    values = torch.where((codes_OI & 8).bool(), -magnitude, magnitude)
    exponent_OG = scale_OG.to(torch.int32) - E8M0_BIAS
    scale = torch.ldexp(torch.ones_like(exponent_OG, dtype=torch.float32), exponent_OG)
    values = values.view(rows, -1, GROUP_SIZE) * scale.unsqueeze(-1)
    return values.view(rows, -1).to(dtype)


def quantize_mxfp4(weight_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] (I a multiple of 32) -> (weight_packed uint8 [O, I/2], weight_scale uint8 [O, I/32])."""
    if weight_OI.dim() != 2 or weight_OI.shape[1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs a 2-D weight whose input width is a multiple of {GROUP_SIZE}, "
                         f"got shape {tuple(weight_OI.shape)}")
    if not torch.isfinite(weight_OI).all():
        raise ValueError("MXFP4 quantisation got non-finite weights (inf or nan)")
    rows, cols = weight_OI.shape
    groups = weight_OI.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(-1)  # [O, G]
    # floor(log2(amax)) exactly, from the float's exponent (frexp: amax = m * 2^e with m in [0.5, 1)).
    _, e = torch.frexp(amax)
    exponent = torch.where(amax > 0, e.to(torch.int32) - 1 - E2M1_MAX_EXPONENT, torch.zeros_like(e, dtype=torch.int32))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exponent).unsqueeze(-1)
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight_OI.device)
    midpoints = (table[1:] + table[:-1]) / 2
    index = torch.bucketize(magnitude, midpoints)  # ties land on the lower code
    at_tie = magnitude == midpoints[index.clamp(max=len(midpoints) - 1)]
    index = torch.where(at_tie & (index % 2 == 1), index + 1, index)  # ties to the even code
    sign = ((scaled < 0) & (index > 0)).to(torch.uint8) << 3
    codes = (index.to(torch.uint8) | sign).view(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = (exponent + E8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def fake_quantize_mxfp4(weight_OI: torch.Tensor) -> torch.Tensor:
    """What a weight becomes after an MXFP4 round trip, in its own dtype: [O, I] -> [O, I]."""
    packed, scale = quantize_mxfp4(weight_OI)
    return dequantize_mxfp4(packed, scale, weight_OI.dtype)
