// The attention inputs of one step from the fused projection qkv[T, (Hq + 2 Hkv) * D]: per head,
// RMSNorm of q and k (Qwen3's q_norm / k_norm; skipped when the weight pointer is null), NeoX rotary
// embedding at positions[t] (float32 table cos_sin[max_pos, D] = [cos | sin]), then q to
// q_out[T, Hq, D] and k, v into their slot of layer in the block-major arena
// kv[num_blocks, num_layers, 2, block_size, Hkv, D] (a negative slot writes nothing). Replaces the
// q/k copies, two rms_norm, rope and write_kv launches; float32 from load to store, one rounding.
//
// Grid (T, ceil((Hq + 2 Hkv) / WARPS)), one warp per head: lane l holds the pairs (i, i + D/2) for
// i = l, l + 32, ... (PAIRS of them), the sum of squares is a warp reduction.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
constexpr int D = HEAD_DIM;
constexpr int HALF = D / 2;
constexpr int PAIRS = (HALF + 31) / 32;
constexpr int WARPS = 4;

extern "C" __global__ void __launch_bounds__(32 * WARPS)
qkv_prepare(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm,
            const bf16_t* __restrict__ k_norm, float eps, const int* __restrict__ positions,
            const float* __restrict__ cos_sin, const int* __restrict__ slots,
            bf16_t* __restrict__ q_out, bf16_t* __restrict__ kv, int num_q_heads,
            int num_kv_heads, int num_layers, int layer, int block_size) {
    const int t = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.y * WARPS + (threadIdx.x >> 5);
    const int num_heads = num_q_heads + 2 * num_kv_heads;
    if (head >= num_heads) return;
    const bf16_t* src = qkv + ((long long)t * num_heads + head) * D;
    const int slot = slots[t];
    const bool is_q = head < num_q_heads;
    const bool is_v = head >= num_q_heads + num_kv_heads;
    bf16_t* dst;
    if (is_q) {
        dst = q_out + ((long long)t * num_q_heads + head) * D;
    } else {
        if (slot < 0) return;
        const int kv_head = head - num_q_heads - (is_v ? num_kv_heads : 0);
        const long long block = slot / block_size, offset = slot % block_size;
        dst = kv + ((((block * num_layers + layer) * 2 + (is_v ? 1 : 0)) * block_size + offset) *
                    num_kv_heads + kv_head) * D;
    }
    if (is_v) {  // v: a plain copy
        for (int i = lane; i < D; i += 32) dst[i] = src[i];
        return;
    }
    float x1[PAIRS], x2[PAIRS];
    float sum_sq = 0.f;
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        const int i = lane + 32 * j;
        x1[j] = i < HALF ? bf16_to_float(src[i]) : 0.f;
        x2[j] = i < HALF ? bf16_to_float(src[HALF + i]) : 0.f;
        sum_sq += x1[j] * x1[j] + x2[j] * x2[j];
    }
    const bf16_t* weight = is_q ? q_norm : k_norm;
    if (weight != nullptr) {
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, m);
        const float inv = 1.f / sqrtf(sum_sq / D + eps);
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int i = lane + 32 * j;
            if (i < HALF) {
                x1[j] = bf16_to_float(weight[i]) * (x1[j] * inv);
                x2[j] = bf16_to_float(weight[HALF + i]) * (x2[j] * inv);
            }
        }
    }
    const float* row = cos_sin + (long long)positions[t] * D;
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        const int i = lane + 32 * j;
        if (i < HALF) {
            const float c = row[i], s = row[HALF + i];
            dst[i] = float_to_bf16(x1[j] * c - x2[j] * s);
            dst[HALF + i] = float_to_bf16(x2[j] * c + x1[j] * s);
        }
    }
}
