// Token selection over float32 logits/probabilities [B, V], one CTA (THREADS threads) per row.
//   argmax:              first index of the row's maximum.
//   softmax_temperature: probs = softmax(logits / temperature), float32.
//   sample_from_probs:   inverse CDF with a host-drawn uniform u: the first id whose cumulative
//                        mass (float64) exceeds u * total, capped to the last id with mass.
#include "common.cuh"

#define THREADS 1024

// (value, index) of the better candidate: larger value, then lower index.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
argmax(const float* __restrict__ logits, int* __restrict__ out, int vocab) {
    __shared__ float s_val[THREADS / 32];
    __shared__ int s_idx[THREADS / 32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float best = __int_as_float(0xff800000);
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += THREADS) better(best, best_i, row[i], i);
    for (int m = 16; m > 0; m >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, m);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, m);
        better(best, best_i, ov, oi);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) better(best, best_i, s_val[w], s_idx[w]);
        out[blockIdx.x] = best_i < vocab ? best_i : 0;  // an all-NaN row: id 0
    }
}

__device__ float block_reduce(float v, bool is_max, float* scratch) {
    v = is_max ? warp_max(v) : warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < THREADS / 32; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
    return r;
}

extern "C" __global__ void __launch_bounds__(THREADS)
softmax_temperature(const float* __restrict__ logits, const float* __restrict__ temperatures,
                    float* __restrict__ probs, int vocab) {
    __shared__ float scratch[THREADS / 32];
    const long long base = (long long)blockIdx.x * vocab;
    const float temperature = temperatures[blockIdx.x];
    float mx = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < vocab; i += THREADS) mx = fmaxf(mx, logits[base + i] / temperature);
    mx = block_reduce(mx, true, scratch);
    float sum = 0.f;
    for (int i = threadIdx.x; i < vocab; i += THREADS) {
        const float e = expf(logits[base + i] / temperature - mx);
        probs[base + i] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, scratch);
    for (int i = threadIdx.x; i < vocab; i += THREADS) probs[base + i] /= sum;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_from_probs(const float* __restrict__ probs, const float* __restrict__ uniforms,
                  int* __restrict__ out, int vocab) {
    __shared__ double s_sum[THREADS];
    __shared__ int s_last[THREADS / 32];
    const float* row = probs + (long long)blockIdx.x * vocab;
    const int chunk = (vocab + THREADS - 1) / THREADS;
    const int begin = min(vocab, (int)threadIdx.x * chunk), end = min(vocab, begin + chunk);
    double sum = 0.0;
    int last = -1;
    for (int i = begin; i < end; ++i) {
        sum += (double)row[i];
        if (row[i] > 0.f) last = i;
    }
    s_sum[threadIdx.x] = sum;
    for (int m = 16; m > 0; m >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, m));
    if ((threadIdx.x & 31) == 0) s_last[threadIdx.x >> 5] = last;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 0; w < THREADS / 32; ++w) last = max(last, s_last[w]);
    double total = 0.0;
    for (int t = 0; t < THREADS; ++t) total += s_sum[t];
    const double target = (double)uniforms[blockIdx.x] * total;
    int id = vocab;  // u * total rounded up to the total: capped below
    double cdf = 0.0;
    for (int t = 0; t < THREADS && id == vocab; ++t) {
        if (cdf + s_sum[t] <= target) {
            cdf += s_sum[t];
            continue;
        }
        // The row's own running sum may round differently from the chunk total: if it never
        // passes the target, the chunk's last id with mass is the draw.
        const int b = min(vocab, t * chunk), e = min(vocab, b + chunk);
        int last_in_chunk = vocab;
        for (int i = b; i < e; ++i) {
            cdf += (double)row[i];
            if (row[i] > 0.f) last_in_chunk = i;
            if (cdf > target) {
                last_in_chunk = i;
                break;
            }
        }
        id = last_in_chunk;
        break;
    }
    out[blockIdx.x] = min(id, max(last, 0));
}
