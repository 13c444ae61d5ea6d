// Scatter this step's k/v[T, Hkv, D] into the block-major arena
// kv[num_blocks, num_layers, 2, block_size, Hkv, D] at layer `layer`: token t goes to block
// slot / block_size, offset slot % block_size (a negative slot is skipped). One thread per 8
// elements of one token's K and V rows (16-byte copies; the launcher requires D % 8 == 0).
#include "common.cuh"

extern "C" __global__ void write_kv(bf16_t* __restrict__ kv, const bf16_t* __restrict__ k,
                                    const bf16_t* __restrict__ v, const int* __restrict__ slots,
                                    int num_tokens, int num_layers, int layer, int block_size,
                                    int num_kv_heads, int head_dim) {
    const int chunks = num_kv_heads * head_dim / 8;  // 16-byte pieces of one token's K row
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_tokens * chunks) return;
    const int t = (int)(idx / chunks);
    const int c = (int)(idx % chunks);
    const int slot = slots[t];
    if (slot < 0) return;
    const long long block = slot / block_size;
    const int offset = slot % block_size;
    const long long row = (long long)num_kv_heads * head_dim;  // elements of one token's K
    const long long k_base = ((block * num_layers + layer) * 2 * block_size + offset) * row;
    const long long v_base = k_base + (long long)block_size * row;
    const long long src = (long long)t * row;
    reinterpret_cast<uint4*>(kv + k_base)[c] = reinterpret_cast<const uint4*>(k + src)[c];
    reinterpret_cast<uint4*>(kv + v_base)[c] = reinterpret_cast<const uint4*>(v + src)[c];
}
