"""A bf16 product ``x @ w.T`` of our own for a decode batch's rows on CUDA (issue 39).

At 128 rows, cuBLAS's bf16 GEMM read the 8B shape's weights at 0.9-1.8 TB/s on an H200
(``python -m bench.splitk``; design/030, section 5), where a one-row mat-vec reached 2.0-3.7:
a 4096 x 4096 weight makes 32 output tiles of 128 x 128 for 132 SMs, so most of the GPU waits.
These kernels split K as well as N, so that every SM streams its own part of the weight. Two
kinds (their CUDA in ``gemm_sources.py``):

- **mma** (any GPU from Ampere on): a block computes a ``BM x BN`` tile of the output over one
  slice of K (``SPLITS`` slices), streaming the rows' and the weight's tiles through shared
  memory with ``cp.async`` in ``STAGES`` buffers, swizzled so that ``ldmatrix`` reads them
  without bank conflicts; each warp multiplies with ``mma.sync`` (bf16 in, fp32 sums).
- **wgmma** (Hopper, ``sm_90``): the weight's rows are the warpgroup instruction's M and the
  batch's rows its N ("swap AB", so a few rows pad nothing), both tiles read by wgmma from
  the same swizzled buffers through its descriptors.

With one slice a block writes bf16; with several, fp32 partial sums that a second kernel adds
in a fixed order and rounds to bf16 (no atomics: the same input gives the same bits).

**Off by default** (:data:`DEFAULT_ON`; ``MLX_TRIO_GEMM_KERNEL=on`` turns it on): both kinds
give cuBLAS's answers, and neither is faster where it would matter. On an H100 the 8B shape's
forward at 128 rows took 10.2-10.5 ms with MLX's cuBLAS products, 11.7 with the wgmma kernel
and 14.9 with the mma one; at 16 rows the wgmma kernel tied (7.7 against 7.6-8.1), at 256 it
lost by 1.27x (design/030, section 9). :func:`sound` checks each kind against MLX's product
once a process before it is used. ``python -m bench.gemm --model-dir DIR`` checks both kinds
and times the model's forward with each against cuBLAS.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from . import gemm_sources as sources
from . import kernel_check
from .fused import FusedLinear
from .switches import env_switch

log = logging.getLogger(__name__)

ENV = "MLX_TRIO_GEMM_KERNEL"
# Off unless asked for: both kinds measured slower than cuBLAS at 64-256 rows (the docstring).
DEFAULT_ON = False

BK = 64  # K a tile: 8 chunks of 16 bytes a row, what the swizzle assumes
WARPS_N = 4  # warps across a tile's columns
MAX_ROWS = 256
MIN_ROWS = 2
MAX_SHARED = 232_448  # bytes of shared memory a block may have on Hopper


@dataclass(frozen=True)
class Plan:
    """One launch's shape: rows a block (``bm``; with ``wgmma``, the batch's rows padded, its
    N), columns a block (``bn``), rows a warp, the pipeline's depth and how many slices of K."""

    bm: int
    bn: int
    warp_m: int
    stages: int
    splits: int
    wgmma: bool = False

    @property
    def threads(self) -> int:
        return 256 if self.wgmma else 32 * (self.bm // self.warp_m) * WARPS_N

    @property
    def shared_bytes(self) -> int:
        # wgmma's stages start 1024-byte aligned: room to align the buffer.
        return self.stages * (self.bm + self.bn) * BK * 2 + (1024 if self.wgmma else 0)


def block_rows(rows: int) -> int:
    """The block's rows for a batch of ``rows``: the smallest of 16, 32, 64, 128 that holds
    them (past 128, blocks of 128)."""
    for bm in (16, 32, 64):
        if rows <= bm:
            return bm
    return 128


@cache
def hopper() -> bool:
    """Whether MLX runs on a Hopper GPU (``sm_90``: H100, H200), the one with wgmma."""
    return mx.cuda.is_available() and mx.device_info(mx.gpu).get("architecture") == "sm_90"


def plan(
    rows: int,
    n: int,
    k: int,
    *,
    splits: int | None = None,
    stages: int = 4,
    bn: int = 128,
    bm: int | None = None,
    wgmma: bool | None = None,
) -> Plan:
    """The launch for ``rows`` x ``k`` times ``k`` x ``n``: enough blocks for every SM to
    stream its part of the weight: K split in the fewest slices (up to 8, each of at least
    ``stages`` tiles) that make about a block for each of an H100/H200's 132 SMs (two for the mma
    kernel, whose blocks are smaller). ``wgmma``: Hopper's kernel (None: on Hopper)."""
    wgmma = (hopper() and sound(wgmma=True)) if wgmma is None else wgmma
    if wgmma:
        bm, bn = max(16, 1 << (rows - 1).bit_length()), 128
        blocks, wanted_blocks = -(-n // bn), 128
    else:
        bm = bm or block_rows(rows)
        blocks, wanted_blocks = -(-rows // bm) * -(-n // bn), 264
    if splits is None:
        splits = 1
        while splits < 8 and blocks * splits < wanted_blocks and k % (BK * splits * 2) == 0:
            if k // (BK * splits * 2) < stages:
                break
            splits *= 2
    return Plan(bm=bm, bn=bn, warp_m=min(bm, 64), stages=stages, splits=splits, wgmma=wgmma)


@cache
def _sum_kernel() -> Callable[..., list[mx.array]]:
    return mx.fast.cuda_kernel(
        name="trio_rows_gemm_sum", input_names=["part"], output_names=["out"], source=sources.SUM
    )


@cache
def _gemm_kernel(shared_bytes: int, wgmma_rows: int = 0) -> Callable[..., list[mx.array]]:
    """The kernel built to request ``shared_bytes`` of shared memory (MLX sets a kernel's
    dynamic shared memory when it is built, one size a kernel object); ``wgmma_rows``: the
    wgmma kernel for that many rows (its instruction names them), else the mma one."""
    kind = f"wgmma_{wgmma_rows}" if wgmma_rows else "gemm"
    return mx.fast.cuda_kernel(
        name=f"trio_rows_{kind}_{shared_bytes}",
        input_names=["x", "w"],
        output_names=["out"],
        source=sources.WGMMA if wgmma_rows else sources.MMA,
        header=sources.wgmma_header(wgmma_rows) if wgmma_rows else sources.HEADER,
        shared_memory=shared_bytes,
    )


def off_by(x: mx.array, w: mx.array, launch: Plan) -> tuple[float, float]:
    """The kernel's (with ``launch``) and MLX's largest difference from a float32 ``x @ w.T``."""
    reference = x.astype(mx.float32) @ w.astype(mx.float32).T

    def worst(product: mx.array) -> float:
        return mx.abs(product.astype(mx.float32) - reference).max().item()

    return worst(run(x, w, launch)), worst(x @ w.T)


@cache
def sound(*, wgmma: bool) -> bool:
    """Whether a kernel gives MLX's answers on this GPU, one slice of K and two: checked once
    a process against MLX's own product, on 40 rows of a 1032 x 1024 weight (a partial block
    of rows and of columns), within twice MLX's error from float32 plus a bf16 step. A kernel
    that fails is not used (logged), so a driver or MLX that reads it otherwise costs speed,
    not answers."""
    x = mx.random.normal((40, 1024), key=mx.random.key(0)).astype(mx.bfloat16)
    w = (mx.random.normal((1032, 1024), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
    kind = "wgmma" if wgmma else "mma"
    return all(
        kernel_check.passes(
            f"the rows' GEMM kernel ({kind}, {splits} slices)",
            lambda splits=splits: off_by(x, w, plan(40, 1032, 1024, splits=splits, wgmma=wgmma)),
        )
        for splits in (1, 2)
    )


def usable(x: mx.array, weight: mx.array) -> bool:
    """Whether :func:`matmul` runs the kernel for ``x @ weight.T``: CUDA, bf16 both, 2-256
    rows, K a multiple of 64 and N of 8."""
    if x.dtype != mx.bfloat16 or weight.dtype != mx.bfloat16 or weight.ndim != 2:
        return False
    k = x.shape[-1]
    rows = x.size // k if k else 0
    return (
        MIN_ROWS <= rows <= MAX_ROWS
        and k == weight.shape[1]
        and k % BK == 0
        and weight.shape[0] % 8 == 0
        and mx.cuda.is_available()
    )


def run(x2: mx.array, weight: mx.array, launch: Plan) -> mx.array:
    """The kernel's ``x2 @ weight.T`` for a 2-D ``x2`` with ``launch``'s shape (no checks)."""
    rows, n = x2.shape[0], weight.shape[0]
    assert launch.shared_bytes <= MAX_SHARED, f"{launch} needs more than a block's memory"
    assert not launch.wgmma or rows <= launch.bm, f"{launch} holds fewer than {rows} rows"
    if launch.wgmma:
        blocks = launch.splits * -(-n // launch.bn)
        template = [
            ("NB", launch.bm),
            ("STAGES", launch.stages),
            ("SPLITS", launch.splits),
            ("BK", BK),
        ]
    else:
        blocks = -(-rows // launch.bm) * launch.splits * -(-n // launch.bn)
        template = [
            ("BM", launch.bm),
            ("BN", launch.bn),
            ("WARP_M", launch.warp_m),
            ("STAGES", launch.stages),
            ("SPLITS", launch.splits),
            ("BK", BK),
            ("WARPS_N", WARPS_N),
        ]
    one = launch.splits == 1
    kernel = _gemm_kernel(launch.shared_bytes, launch.bm if launch.wgmma else 0)
    (part,) = kernel(
        inputs=[x2, weight],
        template=template,
        grid=(blocks * launch.threads, 1, 1),
        threadgroup=(launch.threads, 1, 1),
        output_shapes=[(rows, n) if one else (launch.splits, rows, n)],
        output_dtypes=[mx.bfloat16 if one else mx.float32],
    )
    if one:
        return part
    pairs = rows * n // 2
    (out,) = _sum_kernel()(
        inputs=[part],
        grid=(-(-pairs // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[mx.bfloat16],
    )
    return out


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T``: the kernel where :func:`usable`, else MLX's matmul."""
    if not usable(x, weight):
        return x @ weight.T
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    out = run(x2, weight, planned(x2.shape[0], weight.shape[0], k))
    return out.reshape(*lead, weight.shape[0])


@cache
def planned(rows: int, n: int, k: int) -> Plan:
    """:func:`plan`'s default launch, worked out once a shape (a step makes a few hundred
    products of a handful of shapes)."""
    return plan(rows, n, k)


class RowsLinear(nn.Linear):
    """A plain linear whose products of 2-256 rows run :func:`matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = matmul(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


def wanted(device: str, *, given: bool | None = None) -> bool:
    """Whether to run a model loaded on ``device`` through the kernel: ``given`` if not None,
    else ``MLX_TRIO_GEMM_KERNEL`` (``on``/``off``) if set, else :data:`DEFAULT_ON` on a CUDA
    GPU."""
    if given is not None:
        return given
    setting = env_switch(ENV)
    if setting is None:
        return DEFAULT_ON and device == "gpu" and mx.cuda.is_available()
    return setting


def install(model: nn.Module) -> int:
    """Run ``model``'s plain linears (and its fused groups, ``fused.py``) through
    :func:`matmul`; returns how many it changed (a fused group counts once). A quantized
    linear is not a plain one and stays as it is; :func:`usable` decides, call by call, for
    the others."""
    if mx.cuda.is_available() and not any(  # each kind checked now, not in a forward
        [sound(wgmma=False), hopper() and sound(wgmma=True)]
    ):
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = RowsLinear
            changed += 1
        elif isinstance(module, FusedLinear) and module.group.product is not matmul:
            module.group.product = matmul
            changed += 1
    log.info("%d linears run the rows' GEMM kernel (engine/model/gemm.py)", changed)
    return changed
