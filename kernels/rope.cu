// NeoX rotary embedding of q[T, Hq, D] and k[T, Hkv, D] at positions[T] into new arrays:
// for each head x = (x1, x2) halves, out = (x1 cos - x2 sin, x2 cos + x1 sin), in float32 with the
// float32 table cos_sin[max_pos, D] = [cos | sin]; one rounding to bf16 per output.
// One thread per (token, head of q then k, i < D/2).
#include "common.cuh"

extern "C" __global__ void rope(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                const int* __restrict__ positions,
                                const float* __restrict__ cos_sin, bf16_t* __restrict__ q_out,
                                bf16_t* __restrict__ k_out, int num_tokens, int num_q_heads,
                                int num_kv_heads, int head_dim) {
    const int half = head_dim / 2;
    const int heads = num_q_heads + num_kv_heads;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_tokens * heads * half) return;
    const int i = (int)(idx % half);
    const int head = (int)((idx / half) % heads);
    const int t = (int)(idx / ((long long)half * heads));
    const bf16_t* src;
    bf16_t* dst;
    if (head < num_q_heads) {
        const long long off = ((long long)t * num_q_heads + head) * head_dim;
        src = q + off;
        dst = q_out + off;
    } else {
        const long long off = ((long long)t * num_kv_heads + (head - num_q_heads)) * head_dim;
        src = k + off;
        dst = k_out + off;
    }
    const float* row = cos_sin + (long long)positions[t] * head_dim;
    const float c = row[i], s = row[half + i];
    const float x1 = bf16_to_float(src[i]), x2 = bf16_to_float(src[half + i]);
    dst[i] = float_to_bf16(x1 * c - x2 * s);
    dst[half + i] = float_to_bf16(x2 * c + x1 * s);
}
