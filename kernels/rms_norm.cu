// RMSNorm over the last axis of bf16 rows, optionally fused with the residual add:
//   s = x + residual (rounded to bf16, the new residual stream), out = w * bf16(s * rsqrt(mean(s^2)
//   + eps)), variance accumulated in float32. One warp per row (rows may be [T, H] hidden states or
//   [T * heads, D] for the per-head q/k norm); 16-byte accesses when the row is a multiple of 8.
// residual/new_residual are null for the plain norm. The second pass re-reads x (and residual) and
// recomputes s rather than reading new_residual back: no load of what this kernel wrote.
#include "common.cuh"

extern "C" __global__ void rms_norm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ residual,
                                    const bf16_t* __restrict__ weight, bf16_t* __restrict__ out,
                                    bf16_t* __restrict__ new_residual, long long num_rows, int hidden,
                                    float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= num_rows) return;
    const long long base = row * hidden;
    const bool fused = residual != nullptr;
    float sum_sq = 0.f;
    if ((hidden & 7) == 0) {
        const int num_chunks = hidden / 8;
        const uint4* xv = reinterpret_cast<const uint4*>(x + base);
        for (int i = lane; i < num_chunks; i += 32) {
            float v[8];
            unpack8(xv[i], v);
            if (fused) {
                float r[8];
                unpack8(reinterpret_cast<const uint4*>(residual + base)[i], r);
                for (int j = 0; j < 8; ++j) v[j] = bf16_to_float(float_to_bf16(v[j] + r[j]));
                reinterpret_cast<uint4*>(new_residual + base)[i] = pack8(v);
            }
            for (int j = 0; j < 8; ++j) sum_sq += v[j] * v[j];
        }
        const float rstd = 1.f / sqrtf(warp_sum(sum_sq) / hidden + eps);
        const uint4* wv = reinterpret_cast<const uint4*>(weight);
        for (int i = lane; i < num_chunks; i += 32) {
            float v[8], w[8];
            unpack8(xv[i], v);
            if (fused) {
                float r[8];
                unpack8(reinterpret_cast<const uint4*>(residual + base)[i], r);
                for (int j = 0; j < 8; ++j) v[j] = bf16_to_float(float_to_bf16(v[j] + r[j]));
            }
            unpack8(wv[i], w);
            for (int j = 0; j < 8; ++j) v[j] = w[j] * bf16_to_float(float_to_bf16(v[j] * rstd));
            reinterpret_cast<uint4*>(out + base)[i] = pack8(v);
        }
    } else {
        for (int i = lane; i < hidden; i += 32) {
            float v = bf16_to_float(x[base + i]);
            if (fused) {
                const bf16_t s = float_to_bf16(v + bf16_to_float(residual[base + i]));
                new_residual[base + i] = s;
                v = bf16_to_float(s);
            }
            sum_sq += v * v;
        }
        const float rstd = 1.f / sqrtf(warp_sum(sum_sq) / hidden + eps);
        for (int i = lane; i < hidden; i += 32) {
            float v = bf16_to_float(x[base + i]);
            if (fused) v = bf16_to_float(float_to_bf16(v + bf16_to_float(residual[base + i])));
            const float normed = bf16_to_float(float_to_bf16(v * rstd));
            out[base + i] = float_to_bf16(bf16_to_float(weight[i]) * normed);
        }
    }
}
