"""MXFP4 (compressed-tensors mxfp4-pack-quantized): code table, nibble order, scales, quantisation."""

from __future__ import annotations

import pytest
import torch

from k3.checkpoint.mxfp4 import dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4


def test_every_code_decodes_to_its_e2m1_value():
    # Byte b holds code b & 0xF in its low nibble (even column) and b >> 4 in its high nibble (odd column).
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes.flip(0) << 4)).view(1, 16)  # 32 columns: one group
    unit_scale = torch.tensor([[127]], dtype=torch.uint8)
    values = dequantize_mxfp4(packed, unit_scale, torch.float32).view(-1)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(magnitudes + [-m for m in magnitudes])
    assert torch.equal(values[0::2], table)
    assert torch.equal(values[1::2], table.flip(0))


def test_scale_byte_is_a_power_of_two_exponent():
    packed = torch.full((3, 16), 0x22, dtype=torch.uint8)  # every element code 2 (= 1.0)
    scales = torch.tensor([[127], [130], [120]], dtype=torch.uint8)
    values = dequantize_mxfp4(packed, scales, torch.float32)
    assert torch.equal(values, torch.tensor([1.0, 8.0, 2.0 ** -7]).view(3, 1).expand(3, 32))


def test_quantisation_is_stable_after_one_round_trip():
    weight = torch.randn(48, 96) * 0.02
    packed, scale = quantize_mxfp4(weight)
    assert packed.shape == (48, 48) and scale.shape == (48, 3)
    once = dequantize_mxfp4(packed, scale, torch.float32)
    twice_packed, twice_scale = quantize_mxfp4(once)
    assert torch.equal(twice_packed, packed) and torch.equal(twice_scale, scale)
    # Random codes and scales: dequantise -> quantise -> dequantise returns the same values.
    codes = torch.randint(0, 256, (16, 64), dtype=torch.uint8)
    scales = torch.randint(110, 140, (16, 4), dtype=torch.uint8)
    values = dequantize_mxfp4(codes, scales, torch.bfloat16)
    assert torch.equal(fake_quantize_mxfp4(values), values)


def test_quantisation_error_is_that_of_mxfp4():
    weight = torch.randn(64, 256)
    error = (fake_quantize_mxfp4(weight) - weight).norm() / weight.norm()
    # E2M1 keeps one mantissa bit: about 10% relative error on Gaussian weights, never zero.
    assert 0.05 < error.item() < 0.2
    exact = torch.tensor([[0.5, -1.0, 1.5, 6.0] * 8])  # already on the grid with scale 1
    assert torch.equal(fake_quantize_mxfp4(exact), exact)
    assert quantize_mxfp4(exact)[1].item() == 127


def test_ties_round_to_even_codes_and_values_saturate():
    # amax 6 -> scale 2^0; 0.25 ties 0/0.5 -> 0, 0.75 ties 0.5/1 -> 1, 2.5 ties 2/3 -> 2, 5 ties 4/6 -> 4.
    row = torch.tensor([[6.0, 0.25, 0.75, 2.5, 5.0, -1.25] + [0.0] * 26])
    assert fake_quantize_mxfp4(row)[0, :6].tolist() == [6.0, 0.0, 1.0, 2.0, 4.0, -1.0]
    # amax 7 shares exponent 2 with 4..8: it saturates at 6 instead of doubling the scale.
    assert fake_quantize_mxfp4(torch.tensor([[7.0] + [1.0] * 31]))[0, 0].item() == 6.0


def test_bad_inputs_are_explained():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="covers"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
