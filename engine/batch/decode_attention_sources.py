"""The CUDA of ``decode_attention.py``'s kernel: ``HEADER`` (its helpers) and ``SOURCE`` (the
body MLX wraps in a kernel of inputs ``q``, ``k``, ``v``, ``mask``, ``scale`` and output ``out``,
templated on ``T`` (a 2-byte float), ``D`` (head size), ``G`` (query heads a KV head), ``WARPS``
(warps a block) and ``U`` (keys a group of lanes loads before it uses the first))."""

HEADER = """
#define TRIO_NEG_INF __int_as_float(0xff800000)
// 4 elements of a 2-byte type from p (stride apart), as they lie in memory: one 8-byte load
// where they are contiguous and aligned (`fast`, the same for every lane of the block).
template <typename T>
__device__ __forceinline__ uint2 trio_raw4(const T* p, int64_t stride, bool fast) {
    static_assert(sizeof(T) == 2, "a 2-byte float");
    if (fast) return *reinterpret_cast<const uint2*>(p);
    uint2 raw;
    T* h = reinterpret_cast<T*>(&raw);
    #pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = p[i * stride];
    return raw;
}
template <typename T>
__device__ __forceinline__ void trio_floats4(uint2 raw, float* out) {
    const T* h = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = static_cast<float>(h[i]);
}
__device__ __forceinline__ bool trio_aligned8(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 7) == 0;
}
// exp(a - b) for a softmax's running maximum a that may still be TRIO_NEG_INF (no key yet): 0.
__device__ __forceinline__ float trio_rescale(float a, float b) {
    return a == TRIO_NEG_INF ? 0.0f : expf(a - b);
}
"""

# A block per row and KV head (blockIdx.y, blockIdx.x); its G query heads together. A key's D
# elements are read by LPK lanes, 4 each, so a warp reads KW keys side by side. Each group of
# lanes loads U keys (and their values and mask entries) before it uses the first: the loads
# in flight are what reach the memory's bandwidth. It keeps its own running maximum, sum and
# output (online softmax, float32), merged across the warp by shuffles and across the WARPS
# warps through shared memory. Four elements a lane (not more) keep a lane's registers few
# enough for several blocks an SM.
SOURCE = """
    constexpr int E = 4;
    constexpr int LPK = D / E;
    constexpr int KW = 32 / LPK;
    constexpr int STEP = WARPS * KW * U;
    const int H = q_shape[1];
    const int L = k_shape[2];
    const int kvh = blockIdx.x;
    const int b = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int sub = lane % LPK;
    const int slot = lane / LPK;
    const float s0 = scale[0];

    const T* qp = q + b * q_strides[0] + (int64_t)kvh * G * q_strides[1] + sub * E * q_strides[3];
    const T* kp = k + b * k_strides[0] + kvh * k_strides[1] + sub * E * k_strides[3];
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1] + sub * E * v_strides[3];
    const bool* mp = mask + (mask_shape[0] == 1 ? 0 : b) * mask_strides[0];
    const int64_t ks = k_strides[2], vs = v_strides[2], ms = mask_strides[3];
    const bool fast = k_strides[3] == 1 && v_strides[3] == 1 && ks % E == 0 && vs % E == 0
        && trio_aligned8(k + b * k_strides[0] + kvh * k_strides[1])
        && trio_aligned8(v + b * v_strides[0] + kvh * v_strides[1]);

    float qv[G][E], o[G][E], m[G], s[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        trio_floats4<T>(trio_raw4(qp + g * q_strides[1], q_strides[3], false), qv[g]);
        m[g] = TRIO_NEG_INF;
        s[g] = 0.0f;
        #pragma unroll
        for (int i = 0; i < E; ++i) {
            qv[g][i] *= s0;
            o[g][i] = 0.0f;
        }
    }

    for (int base = warp * KW * U; base < L; base += STEP) {
        uint2 kr[U], vr[U];
        bool keep[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * KW + slot;
            const int at = j < L ? j : 0;
            kr[u] = trio_raw4(kp + at * ks, k_strides[3], fast);
            vr[u] = trio_raw4(vp + at * vs, v_strides[3], fast);
            keep[u] = j < L && mp[at * ms];
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float kk[E];
                trio_floats4<T>(kr[u], kk);
                dot[u] = 0.0f;
                #pragma unroll
                for (int i = 0; i < E; ++i) dot[u] += qv[g][i] * kk[i];
            }
            #pragma unroll
            for (int off = LPK / 2; off > 0; off >>= 1) {
                #pragma unroll
                for (int u = 0; u < U; ++u) dot[u] += __shfl_xor_sync(0xffffffff, dot[u], off);
            }
            float top = m[g];
            #pragma unroll
            for (int u = 0; u < U; ++u) top = keep[u] ? fmaxf(top, dot[u]) : top;
            if (top != TRIO_NEG_INF) {
                const float c = trio_rescale(m[g], top);
                s[g] *= c;
                #pragma unroll
                for (int i = 0; i < E; ++i) o[g][i] *= c;
                #pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (keep[u]) {
                        const float p = expf(dot[u] - top);
                        float vv[E];
                        trio_floats4<T>(vr[u], vv);
                        s[g] += p;
                        #pragma unroll
                        for (int i = 0; i < E; ++i) o[g][i] += p * vv[i];
                    }
                }
                m[g] = top;
            }
        }
    }

    // The warp's KW groups of lanes into one (each lane then holds the merged state).
    #pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffff, m[g], off);
            const float s2 = __shfl_xor_sync(0xffffffff, s[g], off);
            const float top = fmaxf(m[g], m2);
            const float c1 = trio_rescale(m[g], top), c2 = trio_rescale(m2, top);
            s[g] = s[g] * c1 + s2 * c2;
            #pragma unroll
            for (int i = 0; i < E; ++i) {
                const float o2 = __shfl_xor_sync(0xffffffff, o[g][i], off);
                o[g][i] = o[g][i] * c1 + o2 * c2;
            }
            m[g] = top;
        }
    }

    __shared__ float top_of[WARPS][G];
    __shared__ float sum_of[WARPS][G];
    __shared__ float out_of[WARPS][G][D];
    if (slot == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            if (sub == 0) {
                top_of[warp][g] = m[g];
                sum_of[warp][g] = s[g];
            }
            #pragma unroll
            for (int i = 0; i < E; ++i) out_of[warp][g][sub * E + i] = o[g][i];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += WARPS * 32) {
        const int g = e / D, d = e % D;
        float top = TRIO_NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, top_of[w][g]);
        float sum = 0.0f, acc = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float c = trio_rescale(top_of[w][g], top);
            sum += sum_of[w][g] * c;
            acc += out_of[w][g][d] * c;
        }
        out[((int64_t)b * H + kvh * G + g) * D + d] = static_cast<T>(sum > 0.0f ? acc / sum : 0.0f);
    }
"""
