"""The CUDA sources of the rows' GEMM kernels (``gemm.py``): MLX's ``mx.fast.cuda_kernel``
writes each kernel's signature (its inputs ``x``, ``w`` and their shapes, its output ``out``) and
its compile-time constants; these are the bodies, and the helpers before them.

Tiles of K are ``BK`` = 64 wide: a row of a tile is 128 bytes, 8 chunks of 16, and chunk ``c``
of row ``r`` sits at ``c ^ (r % 8)`` (the swizzle that ``ldmatrix`` reads without bank
conflicts, and the 128-byte one that wgmma's descriptors name).
"""

from __future__ import annotations

HEADER = """
__device__ __forceinline__ unsigned trio_smem(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void trio_cp16(unsigned dst, const void* src, bool valid) {
    int size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"
                 :: "r"(dst), "l"(src), "r"(size));
}
__device__ __forceinline__ void trio_commit() { asm volatile("cp.async.commit_group;\\n" ::); }
template <int PENDING>
__device__ __forceinline__ void trio_wait() {
    asm volatile("cp.async.wait_group %0;\\n" :: "n"(PENDING));
}
__device__ __forceinline__ void trio_ldmatrix4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void trio_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

# The body of the kernel (MLX writes its signature): x (M x K), w (N x K), both bf16 and row
# contiguous; out is (M x N) bf16 with one slice, (SPLITS x M x N) fp32 with several.
# Compile-time: BM, BN, WARP_M (rows a warp), STAGES, SPLITS, BK (64).
MMA = """
    constexpr int WARPS_M = BM / WARP_M;
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int WARP_N = BN / WARPS_N;
    constexpr int MT = WARP_M / 16;
    constexpr int NT = WARP_N / 8;
    constexpr int CHUNKS = BK / 8;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    extern __shared__ __align__(128) unsigned char trio_shared[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(trio_shared);
    __nv_bfloat16* ws = xs + STAGES * BM * BK;

    const int m_blocks = (M + BM - 1) / BM;
    int block = blockIdx.x;
    const int m0 = (block % m_blocks) * BM;
    block /= m_blocks;
    const int split = block % SPLITS;
    const int n0 = (block / SPLITS) * BN;
    const int k_len = K / SPLITS;
    const int k_begin = split * k_len;
    const int tiles = k_len / BK;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wm = warp / WARPS_N;
    const int wn = warp % WARPS_N;

    auto load = [&](int stage, int tile) {
        const int k0 = k_begin + tile * BK;
        __nv_bfloat16* xd = xs + stage * BM * BK;
        __nv_bfloat16* wd = ws + stage * BN * BK;
        #pragma unroll
        for (int c = tid; c < BM * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, ch = c % CHUNKS;
            const bool valid = m0 + r < M;
            const __nv_bfloat16* src = x + (size_t)(valid ? m0 + r : 0) * K + k0 + ch * 8;
            trio_cp16(trio_smem(xd + r * BK + ((ch ^ (r & 7)) << 3)), src, valid);
        }
        #pragma unroll
        for (int c = tid; c < BN * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, ch = c % CHUNKS;
            const bool valid = n0 + r < N;
            const __nv_bfloat16* src = w + (size_t)(valid ? n0 + r : 0) * K + k0 + ch * 8;
            trio_cp16(trio_smem(wd + r * BK + ((ch ^ (r & 7)) << 3)), src, valid);
        }
    };

    float acc[MT][NT][4];
    #pragma unroll
    for (int i = 0; i < MT; ++i)
        #pragma unroll
        for (int j = 0; j < NT; ++j)
            #pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) load(s, s);
        trio_commit();
    }
    for (int t = 0; t < tiles; ++t) {
        trio_wait<STAGES - 2>();
        __syncthreads();
        const int next = t + STAGES - 1;
        if (next < tiles) load(next % STAGES, next);
        trio_commit();
        const __nv_bfloat16* xt = xs + (t % STAGES) * BM * BK;
        const __nv_bfloat16* wt = ws + (t % STAGES) * BN * BK;
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned a[MT][4];
            unsigned b[NT][2];
            #pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r = wm * WARP_M + i * 16 + (lane & 15);
                const int ch = kk * 2 + (lane >> 4);
                trio_ldmatrix4(a[i], trio_smem(xt + r * BK + ((ch ^ (r & 7)) << 3)));
            }
            #pragma unroll
            for (int j = 0; j < NT; j += 2) {
                const int r = wn * WARP_N + j * 8 + (lane & 7) + ((lane >> 4) << 3);
                const int ch = kk * 2 + ((lane >> 3) & 1);
                unsigned q[4];
                trio_ldmatrix4(q, trio_smem(wt + r * BK + ((ch ^ (r & 7)) << 3)));
                b[j][0] = q[0];
                b[j][1] = q[1];
                b[j + 1][0] = q[2];
                b[j + 1][1] = q[3];
            }
            #pragma unroll
            for (int i = 0; i < MT; ++i)
                #pragma unroll
                for (int j = 0; j < NT; ++j) trio_mma(acc[i][j], a[i], b[j][0], b[j][1]);
        }
    }
    trio_wait<0>();

    #pragma unroll
    for (int i = 0; i < MT; ++i) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = n0 + wn * WARP_N + j * 8 + (lane & 3) * 2;
            if (n >= N) continue;
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int m = m0 + wm * WARP_M + i * 16 + (lane >> 2) + half * 8;
                if (m >= M) continue;
                const float v0 = acc[i][j][half * 2];
                const float v1 = acc[i][j][half * 2 + 1];
                if constexpr (SPLITS == 1) {
                    *reinterpret_cast<__nv_bfloat162*>(out + (size_t)m * N + n) =
                        __floats2bfloat162_rn(v0, v1);
                } else {
                    *reinterpret_cast<float2*>(out + ((size_t)split * M + m) * N + n) =
                        make_float2(v0, v1);
                }
            }
        }
    }
"""

# Hopper's path: the weight's rows are wgmma's M (64 a warpgroup, two warpgroups a block of
# 128) and the batch's rows its N (``NB``, a multiple of 8 up to 256), so a few rows cost no
# padding of M ("swap AB"). Both tiles sit K-major in shared memory with the 128-byte swizzle
# that wgmma's descriptors name (the same XOR of a row's 16-byte chunks as above), each stage
# 1024-byte aligned. One warpgroup instruction a 16-wide step of K; out as above.
WGMMA_HEADER = """
__device__ __forceinline__ unsigned long long trio_desc(unsigned addr) {
    unsigned long long d = (unsigned long long)((addr & 0x3FFFF) >> 4);
    d |= (unsigned long long)1 << 16;            // leading byte offset: unused when swizzled
    d |= (unsigned long long)(1024 >> 4) << 32;  // stride byte offset: 8 rows of 128 bytes
    d |= (unsigned long long)1 << 62;            // 128-byte swizzle
    return d;
}
template <int SUMS>
__device__ __forceinline__ void trio_fence_sums(float* d) {
    #pragma unroll
    for (int i = 0; i < SUMS; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
"""


def wgmma_header(nb: int) -> str:
    """The header of the ``NB = nb`` kernel: its wgmma, ``nb / 2`` fp32 sums a thread."""
    sums = nb // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(sums))
    names = ", ".join(f"%{i}" for i in range(sums))
    return (
        HEADER
        + WGMMA_HEADER
        + f"""
__device__ __forceinline__ void trio_wgmma(float* d, unsigned long long da,
                                           unsigned long long db) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{sums + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{nb}k16.f32.bf16.bf16 "
        "{{{names}}}, %{sums}, %{sums + 1}, p, 1, 1, 0, 0;\\n}}\\n"
        : {outs}
        : "l"(da), "l"(db), "r"(1));
}}
"""
    )


WGMMA = """
    constexpr int THREADS = 256;
    constexpr int BW = 128;
    constexpr int STAGE = (BW + NB) * BK * 2;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    extern __shared__ __align__(1024) unsigned char trio_shared[];
    unsigned char* smem = trio_shared + ((1024 - (trio_smem(trio_shared) & 1023)) & 1023);

    const int split = blockIdx.x % SPLITS;
    const int n0 = (blockIdx.x / SPLITS) * BW;
    const int k_len = K / SPLITS;
    const int k_begin = split * k_len;
    const int tiles = k_len / BK;
    const int tid = threadIdx.x;
    const int wg = tid >> 7;
    const int warp = (tid >> 5) & 3;
    const int lane = tid & 31;

    auto load = [&](int stage, int tile) {
        const int k0 = k_begin + tile * BK;
        unsigned char* wd = smem + stage * STAGE;
        unsigned char* xd = wd + BW * BK * 2;
        #pragma unroll
        for (int c = tid; c < BW * 8; c += THREADS) {
            const int r = c >> 3, ch = c & 7;
            const bool valid = n0 + r < N;
            const __nv_bfloat16* src = w + (size_t)(valid ? n0 + r : 0) * K + k0 + ch * 8;
            trio_cp16(trio_smem(wd + r * 128 + ((ch ^ (r & 7)) << 4)), src, valid);
        }
        #pragma unroll
        for (int c = tid; c < NB * 8; c += THREADS) {
            const int r = c >> 3, ch = c & 7;
            const bool valid = r < M;
            const __nv_bfloat16* src = x + (size_t)(valid ? r : 0) * K + k0 + ch * 8;
            trio_cp16(trio_smem(xd + r * 128 + ((ch ^ (r & 7)) << 4)), src, valid);
        }
    };

    float acc[NB / 2];
    #pragma unroll
    for (int i = 0; i < NB / 2; ++i) acc[i] = 0.0f;

    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) load(s, s);
        trio_commit();
    }
    for (int t = 0; t < tiles; ++t) {
        trio_wait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
        __syncthreads();
        const int next = t + STAGES - 1;
        if (next < tiles) load(next % STAGES, next);
        trio_commit();
        const unsigned wt = trio_smem(smem + (t % STAGES) * STAGE) + wg * 64 * 128;
        const unsigned xt = trio_smem(smem + (t % STAGES) * STAGE + BW * BK * 2);
        // The sums are the wgmmas' until wait_group: fenced as CUTLASS and DeepGEMM do.
        trio_fence_sums<NB / 2>(acc);
        asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            trio_wgmma(acc, trio_desc(wt + kk * 32), trio_desc(xt + kk * 32));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
        trio_fence_sums<NB / 2>(acc);
        asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
        trio_fence_sums<NB / 2>(acc);
    }
    trio_wait<0>();

    const int n_top = n0 + wg * 64 + warp * 16 + (lane >> 2);
    #pragma unroll
    for (int i = 0; i < NB / 8; ++i) {
        const int m = i * 8 + (lane & 3) * 2;
        #pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int mq = m + (q & 1);
            const int nq = n_top + (q >> 1) * 8;
            if (mq < M && nq < N) {
                if constexpr (SPLITS == 1) {
                    out[(size_t)mq * N + nq] = __float2bfloat16(acc[i * 4 + q]);
                } else {
                    out[((size_t)split * M + mq) * N + nq] = acc[i * 4 + q];
                }
            }
        }
    }
"""


# Sums the slices' fp32 partials, in order, into the bf16 output: two columns a thread.
SUM = """
    const int S = part_shape[0];
    const size_t size = (size_t)part_shape[1] * part_shape[2];
    const size_t at = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (at >= size) return;
    float2 sum = *reinterpret_cast<const float2*>(part + at);
    for (int s = 1; s < S; ++s) {
        const float2 v = *reinterpret_cast<const float2*>(part + s * size + at);
        sum.x += v.x;
        sum.y += v.y;
    }
    *reinterpret_cast<__nv_bfloat162*>(out + at) = __floats2bfloat162_rn(sum.x, sum.y);
"""
