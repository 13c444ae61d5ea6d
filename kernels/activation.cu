// Elementwise bf16 kernels around the GEMMs, float32 inside, one rounding per output.
//   silu_and_mul: x[T, 2I] = [gate | up] -> out[T, I] = silu(gate) * up.
//   add_bias:     x[T, N] += bias[N], in place (the GEMM output is ours to change).
// One thread per 8 elements (16-byte accesses) when the row is a multiple of 8, else per element.
#include "common.cuh"

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

extern "C" __global__ void silu_and_mul(const bf16_t* __restrict__ x, bf16_t* __restrict__ out,
                                        long long num_rows, int width) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((width & 7) == 0) {
        const int chunks = width / 8;
        if (idx >= num_rows * chunks) return;
        const long long row = idx / chunks;
        const int c = (int)(idx % chunks);
        const uint4* gate = reinterpret_cast<const uint4*>(x + row * 2 * width);
        const uint4* up = reinterpret_cast<const uint4*>(x + row * 2 * width + width);
        float g[8], u[8];
        unpack8(gate[c], g);
        unpack8(up[c], u);
        for (int j = 0; j < 8; ++j) g[j] = silu(g[j]) * u[j];
        reinterpret_cast<uint4*>(out + row * width)[c] = pack8(g);
    } else {
        if (idx >= num_rows * width) return;
        const long long row = idx / width;
        const int c = (int)(idx % width);
        const float g = bf16_to_float(x[row * 2 * width + c]);
        const float u = bf16_to_float(x[row * 2 * width + width + c]);
        out[idx] = float_to_bf16(silu(g) * u);
    }
}

extern "C" __global__ void add_bias(bf16_t* __restrict__ x, const bf16_t* __restrict__ bias,
                                    long long num_rows, int width) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= num_rows * width) return;
    const int c = (int)(idx % width);
    x[idx] = float_to_bf16(bf16_to_float(x[idx]) + bf16_to_float(bias[c]));
}
