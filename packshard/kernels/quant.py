"""Per-token fp8 e4m3 quantization with power-of-two (UE8M0) scales, for the DSA indexer.

For each D-vector x (one token of k, one (token, head) of q):

    s  = 2 ** ceil(log2(max(amax(|x|), eps) / 448))      (an exact power of two)
    x8 = clamp(x / s, -448, 448) rounded to e4m3 (round to nearest, ties to even)

so that x ~= s * x8 and the scale is representable as a bare 8-bit exponent (UE8M0).

Two implementations that give bitwise-identical results (pinned by tests/kernels):

- `quantize_fp8_torch`: plain torch ops; the only path on CPU. Triton 3.9's interpreter
  (TRITON_INTERPRET=1) converts float32 to fp8 e4m3 wrongly for some values (126.0 -> 64.0,
  136.0 -> 144.0, 50.0 -> 52.0 where round-to-nearest-even gives 128, 128, 48), so nothing on
  CPU may convert to fp8 inside a Triton kernel.
- `_quant_kernel` (Triton, CUDA only): one pass, bf16 in, fp8 + scale out. The torch sequence
  moves ~17 bytes per element (upcast, abs, amax, divide, clamp, convert: about 4 ms for q at
  S=64K, H=64, D=128 on an H200); the kernel moves 3 (read 2, write 1).

`ceil(log2(r))` is taken from the float's bits (exponent, plus one unless the mantissa is
zero), never from `log2`, whose rounding could move an exact power of two up a step. The
division by 448 is IEEE round-to-nearest in both paths (`div_rn` in Triton: plain `/` there is
an approximate division).

A token holding NaN or +-inf gets a NaN scale; callers check the scales and raise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from packshard.kernels._triton_env import interpreting

FP8_MAX = 448.0
DEFAULT_EPS = 1e-4
FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8_torch(
    x: torch.Tensor, eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of `x` per vector; returns (x8 float8_e4m3fn, scale float32).

    `scale` has shape `x.shape[:-1]` and holds exact powers of two (NaN where the vector held
    NaN or +-inf); `x8.float() * scale[..., None]` approximates `x`.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    r = amax.clamp_min(eps) / FP8_MAX
    mant, expo = torch.frexp(r)  # r = mant * 2**expo, mant in [0.5, 1)
    e = torch.where(mant == 0.5, expo - 1, expo)
    scale = torch.ldexp(torch.ones_like(r), e)
    x8 = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return x8, scale


@triton.jit(do_not_specialize=["n_rows"])  # one binary for every token count
def _quant_kernel(
    x_ptr, y_ptr, s_ptr, n_rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr
):
    """One program quantizes ROWS vectors of length D (BLOCK_D = next power of two >= D)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    m = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    bad = tl.max(((x != x) | (ax == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.max(ax, axis=1)
    r = tl.math.div_rn(tl.maximum(amax, eps), 448.0)
    bits = r.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    tl.store(y_ptr + offs, y.to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + rows, tl.where(bad, float("nan"), scale), mask=rows < n_rows)


def _triton_quant_usable(x: torch.Tensor) -> bool:
    return x.is_cuda and not interpreting()


def quantize_fp8(x: torch.Tensor, eps: float = DEFAULT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector UE8M0 fp8 quantization of the last dim: the Triton kernel on CUDA, torch elsewhere."""
    if not _triton_quant_usable(x):
        return quantize_fp8_torch(x, eps)
    d = x.shape[-1]
    flat = x.reshape(-1, d).contiguous()
    n = flat.shape[0]
    y = torch.empty((n, d), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((n,), dtype=torch.float32, device=x.device)
    rows = 16
    if n:
        _quant_kernel[(triton.cdiv(n, rows),)](
            flat, y, s, n, eps, D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=rows, num_warps=4
        )
    return y.reshape(x.shape), s.reshape(x.shape[:-1])
