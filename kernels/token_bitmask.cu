// Grammar masks on logits: logits[rows[r], v] = -inf wherever bit v of bitmask row r is 0.
//   logits[B, V] float32 (in place), bitmask[R, W] int32 (bit v % 32 of word v / 32 is token v,
//   llguidance's layout; W * 32 >= V), rows[R] int32: the logits row each mask row applies to
//   (distinct). Thread per token: a warp's 32 threads read one word (one broadcast load) and
//   write only the tokens it refuses, coalesced; rows not named are never touched.
#include "common.cuh"

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
apply_token_bitmask(float* __restrict__ logits, const int* __restrict__ bitmask,
                    const int* __restrict__ rows, int vocab, int num_words) {
    const int r = blockIdx.y;
    const int v = blockIdx.x * THREADS + threadIdx.x;
    if (v >= vocab) return;
    const unsigned word = (unsigned)bitmask[(long long)r * num_words + (v >> 5)];
    if (!((word >> (v & 31)) & 1u)) {
        logits[(long long)rows[r] * vocab + v] = __int_as_float(0xff800000);
    }
}
