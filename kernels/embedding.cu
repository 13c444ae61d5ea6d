// Embedding gather: out[t, :] = table[token_ids[t], :] for bf16 rows. One CTA per token; 16-byte
// copies when the row is a multiple of 8 elements. An id outside [0, V) gives a zero row (the
// engine validates ids first; this keeps a bad id from reading out of bounds).
#include "common.cuh"

extern "C" __global__ void embedding(const int* __restrict__ token_ids,
                                     const bf16_t* __restrict__ table,
                                     bf16_t* __restrict__ out, int hidden, long long vocab) {
    const int t = blockIdx.x;
    const long long id = token_ids[t];
    const bool valid = id >= 0 && id < vocab;
    bf16_t* dst = out + (long long)t * hidden;
    const bf16_t* src = table + (valid ? id : 0) * (long long)hidden;
    if ((hidden & 7) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) d[i] = valid ? s[i] : zero;
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = valid ? src[i] : 0;
    }
}
