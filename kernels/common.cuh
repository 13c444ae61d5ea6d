// Helpers shared by the kernels: bf16 <-> float32 and vector loads. No headers: NVRTC here cannot
// include the C++ standard library, so bf16 is carried as its 16-bit pattern (unsigned short),
// widened by shifting and narrowed by the sm_80+ cvt instructions. The launchers
// (kernels/cuda_module.py) inline this file where a .cu says #include "common.cuh".
#pragma once

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_to_float(bf16_t x) {
    return __uint_as_float(((unsigned)x) << 16);
}

// Round to nearest even, as every framework converts (one sm_80+ instruction).
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two floats as one 32-bit word of bf16: ``lo`` at the lower address (the lower 16 bits). The
// instruction puts its first source in the upper half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16x2_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// Eight bf16 held in a uint4 (one 16-byte load) <-> eight floats.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    f[0] = bf16x2_lo(v.x); f[1] = bf16x2_hi(v.x);
    f[2] = bf16x2_lo(v.y); f[3] = bf16x2_hi(v.y);
    f[4] = bf16x2_lo(v.z); f[5] = bf16x2_hi(v.z);
    f[6] = bf16x2_lo(v.w); f[7] = bf16x2_hi(v.w);
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 v;
    v.x = pack_bf16x2(f[0], f[1]);
    v.y = pack_bf16x2(f[2], f[3]);
    v.z = pack_bf16x2(f[4], f[5]);
    v.w = pack_bf16x2(f[6], f[7]);
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}
