"""The CUDA of ``decode_attention.py``'s kernel: ``HEADER`` (its helpers) and ``SOURCE`` (the
body MLX wraps in a kernel of inputs ``q``, ``k``, ``v``, ``mask``, ``scale`` and output ``out``,
templated on ``T``, ``D`` (head size), ``G`` (query heads a KV head) and ``WARPS``)."""

HEADER = """
#define TRIO_NEG_INF __int_as_float(0xff800000)
// 8 elements from p (stride apart), as floats: one 16-byte load where they are contiguous.
template <typename T>
__device__ __forceinline__ void trio_load8(const T* p, int64_t stride, float* out) {
    if (stride == 1 && (reinterpret_cast<unsigned long long>(p) & 15) == 0) {
        if constexpr (sizeof(T) == 2) {
            const uint4 raw = *reinterpret_cast<const uint4*>(p);
            const T* h = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(h[i]);
        } else {
            const float4 a = *reinterpret_cast<const float4*>(p);
            const float4 b = *reinterpret_cast<const float4*>(p + 4);
            out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
            out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
        }
    } else {
        #pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i * stride]);
    }
}
// exp(a - b) for a softmax's running maximum a that may still be TRIO_NEG_INF (no key yet): 0.
__device__ __forceinline__ float trio_rescale(float a, float b) {
    return a == TRIO_NEG_INF ? 0.0f : expf(a - b);
}
"""

# A block per row and KV head (blockIdx.y, blockIdx.x); its G query heads together. A key's D
# elements are read by LPK lanes, 8 each, so a warp takes KW keys at a time; each group of
# lanes keeps its own running maximum, sum and output (online softmax, float32), merged across
# the warp by shuffles and across the WARPS warps through shared memory.
SOURCE = """
    constexpr int LPK = D / 8;
    constexpr int KW = 32 / LPK;
    const int H = q_shape[1];
    const int L = k_shape[2];
    const int kvh = blockIdx.x;
    const int b = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int sub = lane % LPK;
    const int slot = lane / LPK;
    const float s0 = scale[0];

    const T* qp = q + b * q_strides[0] + (int64_t)kvh * G * q_strides[1] + sub * 8 * q_strides[3];
    const T* kp = k + b * k_strides[0] + kvh * k_strides[1] + sub * 8 * k_strides[3];
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1] + sub * 8 * v_strides[3];
    const bool* mp = mask + (mask_shape[0] == 1 ? 0 : b) * mask_strides[0];
    const int64_t ks = k_strides[2], vs = v_strides[2], ms = mask_strides[3];

    float qv[G][8], o[G][8], m[G], s[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        trio_load8(qp + g * q_strides[1], q_strides[3], qv[g]);
        m[g] = TRIO_NEG_INF;
        s[g] = 0.0f;
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            qv[g][i] *= s0;
            o[g][i] = 0.0f;
        }
    }

    #pragma unroll 2
    for (int base = warp * KW; base < L; base += WARPS * KW) {
        const int j = base + slot;
        const bool valid = j < L;
        float kk[8], vv[8];
        trio_load8(kp + (valid ? j : 0) * ks, k_strides[3], kk);
        trio_load8(vp + (valid ? j : 0) * vs, v_strides[3], vv);
        const bool keep = valid && mp[(valid ? j : 0) * ms];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < 8; ++i) dot += qv[g][i] * kk[i];
            #pragma unroll
            for (int off = LPK / 2; off > 0; off >>= 1) {
                dot += __shfl_xor_sync(0xffffffff, dot, off);
            }
            if (keep) {
                const float top = fmaxf(m[g], dot);
                const float c = trio_rescale(m[g], top);
                const float p = expf(dot - top);
                s[g] = s[g] * c + p;
                #pragma unroll
                for (int i = 0; i < 8; ++i) o[g][i] = o[g][i] * c + p * vv[i];
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
            for (int i = 0; i < 8; ++i) {
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
            for (int i = 0; i < 8; ++i) out_of[warp][g][sub * 8 + i] = o[g][i];
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
