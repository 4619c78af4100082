"""The UE8M0 fp8 quantizer: pinned fp8 values (the interpreter's conversion bug), exact scales."""

from __future__ import annotations

import pytest
import torch

from packshard.kernels import quantize_fp8, quantize_fp8_torch


def test_pinned_fp8_values_round_to_nearest_even() -> None:
    # amax 448 -> scale exactly 1, so the fp8 values are the inputs rounded to e4m3.
    # Triton 3.9's interpreter gives 64, 144, 52 for the first three (see kernels/quant.py).
    x = torch.tensor([[126.0, 136.0, 50.0, -126.0, 448.0, 0.0, 1.0 / 256, 17.0, 1.0 / 1024]])
    x8, scale = quantize_fp8(x)
    assert scale.tolist() == [1.0]
    # 17 is halfway between 16 and 18, 2**-10 halfway between 0 and the smallest subnormal 2**-9
    assert x8.float().tolist() == [[128.0, 128.0, 48.0, -128.0, 448.0, 0.0, 1.0 / 256, 16.0, 0.0]]


@pytest.mark.parametrize(
    ("amax", "scale"),
    [
        (448.0, 1.0),
        (449.0, 2.0),
        (224.0, 0.5),
        (224.5, 1.0),
        (448.0 * 2.0**-10, 2.0**-10),
        (0.0, 2.0**-22),
    ],
)
def test_scale_is_the_next_power_of_two(amax: float, scale: float) -> None:
    x = torch.zeros(1, 32)
    x[0, 3] = -amax
    x8, s = quantize_fp8_torch(x)
    assert s.item() == scale
    assert x8.float()[0, 3].item() == pytest.approx(-amax / scale, rel=2**-4)
    assert x8.float().abs().max().item() <= 448.0


def test_bf16_round_trip_and_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 64, generator=g) * 10).bfloat16()
    x8, s = quantize_fp8(x)
    assert x8.shape == (5, 3, 64) and x8.dtype == torch.float8_e4m3fn
    assert s.shape == (5, 3) and s.dtype == torch.float32
    err = (x8.float() * s[..., None] - x.float()).abs().max() / x.float().abs().max()
    assert err < 2**-3  # e4m3 keeps 3 mantissa bits
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all())  # powers of two


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_vectors_get_a_nan_scale(bad: float) -> None:
    x = torch.ones(3, 32)
    x[1, 5] = bad
    _, s = quantize_fp8_torch(x)
    assert torch.isfinite(s[[0, 2]]).all() and torch.isnan(s[1])
