"""A matmul for a few rows on CUDA, as one custom kernel: issue 26's experiment.

MLX runs ``x @ w.T`` for one row as its own mat-vec kernel, but for 2 or more rows it calls
cuBLASLt: each call builds descriptors, asks cuBLASLt for an algorithm and captures the call
into a child CUDA graph, a host cost paid every step that outweighs the arithmetic of a decode
step of a few rows. This kernel reads each weight row once for all rows (a warp a weight row,
16-byte loads, fp32 sums) and is launched like any other MLX kernel.

What it showed on an H200 (``bench/decode_levers.py --micro``): it takes encoding a call from
14-20 us (cuBLASLt) to 4-7 us, but building it in Python costs 6-8 us more than a matmul, and
this naive kernel takes 20 us of GPU time at 8 rows where cuBLAS takes 6: no gain as it is.
A kernel worth having would tile the rows and split K, and be launched from C++.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx

MAX_ROWS = 16
WARPS = 4

_SOURCE = """
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * WARPS + threadIdx.x / 32;
    if (n >= N) return;
    float acc[ROWS];
    #pragma unroll
    for (int m = 0; m < ROWS; ++m) acc[m] = 0.0f;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)n * K);
    for (int k8 = lane; k8 < K / 8; k8 += 32) {
        uint4 wv = wrow[k8];
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
        float2 wf[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) wf[i] = __bfloat1622float2(w2[i]);
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            if (m < M) {
                uint4 xv = reinterpret_cast<const uint4*>(x + (size_t)m * K)[k8];
                const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float2 xf = __bfloat1622float2(x2[i]);
                    acc[m] += xf.x * wf[i].x + xf.y * wf[i].y;
                }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        float v = acc[m];
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffff, v, off);
        if (lane == 0 && m < M) out[(size_t)m * N + n] = __float2bfloat16(v);
    }
"""


@cache
def _kernel() -> Callable[..., list[mx.array]]:
    return mx.fast.cuda_kernel(
        name="skinny_matmul", input_names=["x", "w"], output_names=["out"], source=_SOURCE
    )


def usable(x: mx.array, weight: mx.array) -> bool:
    rows = x.size // x.shape[-1]
    return (
        mx.cuda.is_available()
        and x.dtype == weight.dtype == mx.bfloat16
        and rows <= MAX_ROWS
        and x.shape[-1] % 8 == 0
    )


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for bf16 ``x`` of up to ``MAX_ROWS`` rows; else MLX's matmul."""
    if not usable(x, weight):
        return x @ weight.T
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    rows_bucket = 1 << max(0, (flat.shape[0] - 1).bit_length())
    n = weight.shape[0]
    (out,) = _kernel()(
        inputs=[flat, weight],
        template=[("ROWS", rows_bucket), ("WARPS", WARPS)],
        grid=(-(-n // WARPS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(flat.shape[0], n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)
