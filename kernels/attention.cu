// Paged attention over the block-major arena kv[num_blocks, num_layers, 2, block_size, Hkv, D], bf16
// in, float32 softmax and accumulation, bf16 out. FlashAttention-2 style: each warp owns 16 or 32
// query rows, K/V tiles of 64 keys stream through shared memory (cp.async, double-buffered), scores
// and P @ V run on tensor cores (mma.sync m16n8k16 bf16 -> f32), online softmax in the log2 domain.
//
//   paged_prefill  causal varlen GQA: one CTA per (query head, query tile, context split). Row i
//                  of sequence b sits at position context_lens[b] - q_len + i and sees keys
//                  0..position. The CTA finds its (sequence, tile) by walking cu_seqlens; the grid
//                  is an upper bound on the tile count, so no host sync. Late (heavier) tiles
//                  start first. With more than one split (a few new tokens over a long cached
//                  prefix: too few tiles to fill the GPU) each CTA covers keys_per_split keys and
//                  writes normalized partials that combine_splits merges, as decode does.
//   paged_decode   one query per sequence: one warp per (context split, KV head, sequence); the
//                  group's query heads are the warp's rows, so K/V are read once per KV head.
//   combine_splits merges the splits' normalized partials by their (max, sum).
//
// HEAD_DIM (multiple of 16, <= 256) is a compile-time define, so are PREFILL_WARPS (4 or 8) and
// PREFILL_MT (16-row MMA tiles per warp, 1 or 2): a CTA holds 16 x MT x WARPS query rows; and
// PREFILL_BN (32 or 64 keys per prefill tile). USE_LDMATRIX=0 swaps the ldmatrix fragment loads for plain 32/16-bit
// shared loads (same results; kept as a cross-check).
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef USE_LDMATRIX
#define USE_LDMATRIX 1
#endif
#ifndef PREFILL_WARPS
#define PREFILL_WARPS 4
#endif
#ifndef PREFILL_MT
#define PREFILL_MT 2
#endif
#ifndef PREFILL_BN
#define PREFILL_BN 64
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define NO_POSITION 0x7fffffff

constexpr int D = HEAD_DIM;
constexpr int PREFILL_THREADS = 32 * PREFILL_WARPS;
constexpr int MT = PREFILL_MT;           // 16-row MMA tiles per prefill warp (1 or 2)
constexpr int BM = 16 * MT * PREFILL_WARPS;  // query rows per prefill CTA
constexpr int BN = 64;          // keys per decode tile
constexpr int PBN = PREFILL_BN;  // keys per prefill tile (32 or 64: fewer score registers)
constexpr int STRIDE = D + 8;   // shared row stride (elements): 16-byte pad, conflict-free loads
constexpr int CHUNKS = D / 8;   // 16-byte pieces per row

static_assert(D % 16 == 0 && D <= 256, "HEAD_DIM must be a multiple of 16, at most 256");

// ---- PTX wrappers ------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned r;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^-inf = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned ld_shared_u32(const bf16_t* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// ---- fragment loads from row-major shared tiles (row stride STRIDE) ----------------------------
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4): A regs hold (row g | g+8, cols
// 2t, 2t+1 | +8); B regs hold (k = 2t, 2t+1 | +8, n = g); C holds (row g | g+8, cols 2t, 2t+1).

// A: the 16x16 tile at (row0, col0) of Q.
__device__ __forceinline__ void load_a(unsigned (&a)[4], const bf16_t* s, int row0, int col0,
                                       int lane) {
#if USE_LDMATRIX
    const bf16_t* p = s + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + col0 +
                      (lane >> 4) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_addr(p)));
#else
    const int g = lane >> 2, t = lane & 3;
    a[0] = ld_shared_u32(s + (row0 + g) * STRIDE + col0 + 2 * t);
    a[1] = ld_shared_u32(s + (row0 + g + 8) * STRIDE + col0 + 2 * t);
    a[2] = ld_shared_u32(s + (row0 + g) * STRIDE + col0 + 8 + 2 * t);
    a[3] = ld_shared_u32(s + (row0 + g + 8) * STRIDE + col0 + 8 + 2 * t);
#endif
}

// B for Q K^T: k = 16 dims from col0, n = 8 keys from key0 (K rows are keys).
__device__ __forceinline__ void load_b_k(unsigned& b0, unsigned& b1, const bf16_t* s, int key0,
                                         int col0, int lane) {
#if USE_LDMATRIX
    const int l = lane & 15;
    const bf16_t* p = s + (key0 + (l & 7)) * STRIDE + col0 + (l >> 3) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b0), "=r"(b1) : "r"(smem_addr(p)));
#else
    const int g = lane >> 2, t = lane & 3;
    b0 = ld_shared_u32(s + (key0 + g) * STRIDE + col0 + 2 * t);
    b1 = ld_shared_u32(s + (key0 + g) * STRIDE + col0 + 8 + 2 * t);
#endif
}

// Two B fragments of Q K^T in one ldmatrix (USE_LDMATRIX only): 16 keys from key0 x 16 dims from
// col0 -> (b0, b1) for keys key0..key0+7, (b2, b3) for keys key0+8..key0+15.
__device__ __forceinline__ void load_b_k_pair(unsigned (&b)[4], const bf16_t* s, int key0,
                                              int col0, int lane) {
    const bf16_t* p = s + (key0 + (lane & 7) + (lane >> 4) * 8) * STRIDE + col0 +
                      ((lane >> 3) & 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(smem_addr(p)));
}

// V: 16 keys from key0 x 16 dims from col0 -> (b0, b1) for dims col0.., (b2, b3) for col0 + 8..
__device__ __forceinline__ void load_b_v_x4(unsigned (&b)[4], const bf16_t* s, int key0, int col0,
                                            int lane) {
    const bf16_t* p = s + (key0 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + col0 +
                      (lane >> 4) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(smem_addr(p)));
}

// B for P V: k = 16 keys from key0, n = 8 dims from col0 (V rows are keys: a transposed load).
__device__ __forceinline__ void load_b_v(unsigned& b0, unsigned& b1, const bf16_t* s, int key0,
                                         int col0, int lane) {
#if USE_LDMATRIX
    const bf16_t* p = s + (key0 + (lane & 15)) * STRIDE + col0;
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b0), "=r"(b1) : "r"(smem_addr(p)));
#else
    const int g = lane >> 2, t = lane & 3;
    const bf16_t* p = s + (key0 + 2 * t) * STRIDE + col0 + g;
    b0 = (unsigned)p[0] | ((unsigned)p[STRIDE] << 16);
    b1 = (unsigned)p[8 * STRIDE] | ((unsigned)p[9 * STRIDE] << 16);
#endif
}

// ---- the shared inner step -------------------------------------------------------------------

// One K/V tile for one warp's MT x 16 rows: S = Q K^T (scaled to log2 units), optional mask (a
// key is visible to a row iff key <= the row's position and key < key_limit), online softmax
// update of (m, l, o), o += P V. m is the running max (log2 units), l the thread's partial row
// sum. With MT = 2 every K/V fragment read from shared memory feeds two MMAs (one per 16-row
// tile), halving the shared-memory traffic per FLOP, which bounds the MT = 1 kernel.
template <int MT, int NK, bool MASK>
__device__ __forceinline__ void attend_tile(const bf16_t* sQ, const bf16_t* sK, const bf16_t* sV,
                                            int q_row0, int key_base, int key_limit,
                                            const int (&pos)[MT][2], float scale_log2,
                                            float (&m)[MT][2], float (&l)[MT][2],
                                            float (&o)[MT][D / 8][4], int lane) {
    float s[MT][NK / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt)
            s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a(a[mt], sQ, q_row0 + 16 * mt, kk * 16, lane);
#pragma unroll
        for (int nt = 0; nt < NK / 8; nt += 2) {  // NK / 8 is even
#if USE_LDMATRIX
            unsigned b[4];
            load_b_k_pair(b, sK, nt * 8, kk * 16, lane);
#else
            unsigned b[4];
            load_b_k(b[0], b[1], sK, nt * 8, kk * 16, lane);
            load_b_k(b[2], b[3], sK, nt * 8 + 8, kk * 16, lane);
#endif
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(s[mt][nt], a[mt], b[0], b[1]);
                mma_16816(s[mt][nt + 1], a[mt], b[2], b[3]);
            }
        }
    }
    // Raw scores here; scale_log2 > 0, so the max of the scaled scores is the scaled max and
    // p = 2^(s * scale_log2 - base) is one FFMA + EX2.
    const int t = lane & 3;
    float base[MT][2], alpha[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float raw_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (MASK) {
                    const int key = key_base + nt * 8 + 2 * t + (e & 1);
                    if (key > pos[mt][e >> 1] || key >= key_limit) s[mt][nt][e] = NEG_INF;
                }
                raw_max[e >> 1] = fmaxf(raw_max[e >> 1], s[mt][nt][e]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            raw_max[i] = fmaxf(raw_max[i], __shfl_xor_sync(0xffffffffu, raw_max[i], 1));
            raw_max[i] = fmaxf(raw_max[i], __shfl_xor_sync(0xffffffffu, raw_max[i], 2));
            const float row_max = fmaxf(m[mt][i], raw_max[i] * scale_log2);
            base[mt][i] = row_max == NEG_INF ? 0.f : row_max;  // a row with nothing visible yet
            alpha[mt][i] = fast_exp2(m[mt][i] - base[mt][i]);
            m[mt][i] = row_max;
            l[mt][i] *= alpha[mt][i];
        }
    }
    // Once the row maxima settle, most tiles move none of them: skip the rescale of O then.
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) moved |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                o[mt][nt][0] *= alpha[mt][0];
                o[mt][nt][1] *= alpha[mt][0];
                o[mt][nt][2] *= alpha[mt][1];
                o[mt][nt][3] *= alpha[mt][1];
            }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -base[mt][e >> 1]));
                s[mt][nt][e] = p;
                l[mt][e >> 1] += p;
            }
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            a[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            a[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            a[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nt = 0; nt < D / 8; nt += 2) {  // D / 8 is even
#if USE_LDMATRIX
            unsigned b[4];
            load_b_v_x4(b, sV, kk * 16, nt * 8, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(o[mt][nt], a[mt], b[0], b[1]);
                mma_16816(o[mt][nt + 1], a[mt], b[2], b[3]);
            }
#else
            unsigned b0, b1, b2, b3;
            load_b_v(b0, b1, sV, kk * 16, nt * 8, lane);
            load_b_v(b2, b3, sV, kk * 16, nt * 8 + 8, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(o[mt][nt], a[mt], b0, b1);
                mma_16816(o[mt][nt + 1], a[mt], b2, b3);
            }
#endif
        }
    }
}

// Row sums across the quad that shares a row; 1 / sum (0 for an empty row).
__device__ __forceinline__ void finish_rows(float (&l)[2], float (&inv)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        inv[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
    }
}

struct Arena {
    const bf16_t* kv;
    int num_layers, layer, block_size, block_shift, num_kv_heads;  // block_shift: log2, or -1
};

// Issue the cp.async loads of keys [key_base, key_base + NK) of one sequence and KV head into
// sK/sV; keys at or past key_end are zero-filled (a zero V row keeps masked lanes finite). Each
// thread copies the same 16-byte piece of every (num_threads / CHUNKS)-th row, so the block
// lookup is once per row (a shift when block_size is a power of two).
template <int NK>
__device__ __forceinline__ void load_kv_tile(bf16_t* sK, bf16_t* sV, const Arena& arena,
                                             const int* block_table, int kv_head, int key_base,
                                             int key_end, int tid, int num_threads) {
    const long long row = (long long)arena.num_kv_heads * D;  // elements of one token's K (or V)
    const int ch = tid % CHUNKS;
    const long long piece = (long long)kv_head * D + ch * 8;
    for (int r = tid / CHUNKS; r < NK; r += num_threads / CHUNKS) {
        const int key = key_base + r;
        const bool valid = key < key_end;
        const bf16_t* k_src = arena.kv;
        const bf16_t* v_src = arena.kv;
        if (valid) {
            int index, offset;
            if (arena.block_shift >= 0) {
                index = key >> arena.block_shift;
                offset = key & (arena.block_size - 1);
            } else {
                index = key / arena.block_size;
                offset = key - index * arena.block_size;
            }
            const long long block = block_table[index];
            const long long k_off =
                ((block * arena.num_layers + arena.layer) * 2 * arena.block_size + offset) * row +
                piece;
            k_src = arena.kv + k_off;
            v_src = k_src + (long long)arena.block_size * row;
        }
        cp_async16(sK + r * STRIDE + ch * 8, k_src, valid);
        cp_async16(sV + r * STRIDE + ch * 8, v_src, valid);
    }
}

// ---- prefill --------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)
paged_prefill(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
              const int* __restrict__ block_tables, const int* __restrict__ cu_seqlens,
              const int* __restrict__ context_lens, bf16_t* __restrict__ out,
              float* __restrict__ part_o, float* __restrict__ part_ml, int split_rows,
              int num_seqs, int max_blocks_per_seq, int num_q_heads, int num_layers, int layer, int block_size,
              int block_shift, int num_kv_heads, int keys_per_split, float scale_log2) {
    extern __shared__ uint4 smem_u4[];
    bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_u4);
    bf16_t* sK0 = sQ + BM * STRIDE;
    bf16_t* sV0 = sK0 + PBN * STRIDE;
    bf16_t* sK1 = sV0 + PBN * STRIDE;
    bf16_t* sV1 = sK1 + PBN * STRIDE;
    __shared__ int s_seq, s_tile;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int head = blockIdx.x;
    if (tid == 0) {
        int rem = blockIdx.y, seq = -1;
        for (int b = 0; b < num_seqs; ++b) {
            const int tiles = (cu_seqlens[b + 1] - cu_seqlens[b] + BM - 1) / BM;
            if (rem < tiles) {
                seq = b;
                rem = tiles - 1 - rem;  // heaviest (latest) tile of each sequence first
                break;
            }
            rem -= tiles;
        }
        s_seq = seq;
        s_tile = rem;
    }
    __syncthreads();
    const int seq = s_seq;
    if (seq < 0) return;  // past the last tile: the grid is an upper bound
    const int q_start = cu_seqlens[seq];
    const int q_len = cu_seqlens[seq + 1] - q_start;
    const int context_len = context_lens[seq];
    const int row0 = s_tile * BM;
    const int rows = min(BM, q_len - row0);
    const int pos0 = context_len - q_len + row0;          // position of the tile's first row
    const int key_end = min(context_len, pos0 + rows);    // keys the tile's last row sees
    // This CTA's keys: [key_lo, key_hi) of the split (everything with one split).
    const int num_splits = gridDim.z;
    const int key_lo = blockIdx.z * keys_per_split;
    const int key_hi = num_splits == 1 ? key_end : min(key_end, key_lo + keys_per_split);
    const long long num_rows_total = split_rows;  // rows (token x head) of one split's partials
    if (key_lo >= key_hi) {  // the split lies past what this tile sees: empty partials
        for (int r = tid; r < rows; r += PREFILL_THREADS) {
            const long long idx = blockIdx.z * num_rows_total +
                                  (long long)(q_start + row0 + r) * num_q_heads + head;
            part_ml[idx * 2] = NEG_INF;
            part_ml[idx * 2 + 1] = 0.f;
        }
        return;
    }
    const int num_key_tiles = (key_hi - key_lo + PBN - 1) / PBN;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const Arena arena{kv, num_layers, layer, block_size, block_shift, num_kv_heads};
    const int* block_table = block_tables + (long long)seq * max_blocks_per_seq;

    for (int c = tid; c < BM * CHUNKS; c += PREFILL_THREADS) {
        const int r = c / CHUNKS, ch = c % CHUNKS;
        const bool valid = r < rows;
        const bf16_t* src =
            valid ? q + ((long long)(q_start + row0 + r) * num_q_heads + head) * D + ch * 8 : q;
        cp_async16(sQ + r * STRIDE + ch * 8, src, valid);
    }
    load_kv_tile<PBN>(sK0, sV0, arena, block_table, kv_head, key_lo, key_hi, tid,
                      PREFILL_THREADS);
    cp_async_commit();

    float m[MT][2], l[MT][2];
    float o[MT][D / 8][4];
    int pos[MT][2];
    const int g = lane >> 2;
    const int warp_row0 = warp * 16 * MT;  // the warp's first row in the tile
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
        pos[mt][0] = pos0 + warp_row0 + 16 * mt + g;
        pos[mt][1] = pos[mt][0] + 8;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
            o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.f;
    }
    const int warp_last_pos = pos0 + warp_row0 + 16 * MT - 1;

    for (int j = 0; j < num_key_tiles; ++j) {
        const bool odd = j & 1;
        if (j + 1 < num_key_tiles) {
            load_kv_tile<PBN>(odd ? sK0 : sK1, odd ? sV0 : sV1, arena, block_table, kv_head,
                              key_lo + (j + 1) * PBN, key_hi, tid, PREFILL_THREADS);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int key_base = key_lo + j * PBN;
        const bf16_t* sK = odd ? sK1 : sK0;
        const bf16_t* sV = odd ? sV1 : sV0;
        // Skip a warp whose rows are all padding, or for which every key of the tile is in the
        // future of all its rows. Mask where the diagonal or the split's end cuts the tile.
        if (warp_row0 < rows && key_base <= warp_last_pos) {
            if (key_base + PBN - 1 > pos0 + warp_row0 || key_base + PBN > key_hi)
                attend_tile<MT, PBN, true>(sQ, sK, sV, warp_row0, key_base, key_hi, pos,
                                           scale_log2, m, l, o, lane);
            else
                attend_tile<MT, PBN, false>(sQ, sK, sV, warp_row0, key_base, key_hi, pos,
                                            scale_log2, m, l, o, lane);
        }
        __syncthreads();  // the buffer read here is refilled by the next iteration's prefetch
    }

    const int t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2];
        finish_rows(l[mt], inv);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = warp_row0 + 16 * mt + g + 8 * i;
            if (r >= rows) continue;
            const long long row = (long long)(q_start + row0 + r) * num_q_heads + head;
            if (num_splits == 1) {
                bf16_t* dst = out + row * D + 2 * t;
#pragma unroll
                for (int nt = 0; nt < D / 8; ++nt)
                    *reinterpret_cast<unsigned*>(dst + nt * 8) =
                        pack_bf16x2(o[mt][nt][2 * i] * inv[i], o[mt][nt][2 * i + 1] * inv[i]);
            } else {
                const long long idx = blockIdx.z * num_rows_total + row;
                float* dst = part_o + idx * D + 2 * t;
#pragma unroll
                for (int nt = 0; nt < D / 8; ++nt) {
                    dst[nt * 8] = o[mt][nt][2 * i] * inv[i];
                    dst[nt * 8 + 1] = o[mt][nt][2 * i + 1] * inv[i];
                }
                if (t == 0) {
                    part_ml[idx * 2] = m[mt][i];
                    part_ml[idx * 2 + 1] = l[mt][i];
                }
            }
        }
    }
}

// ---- decode -----------------------------------------------------------------------------------

// Grid (num_splits, Hkv, B), one warp. Rows 0..G-1 are the query heads of KV head blockIdx.y.
// With one split the normalized output goes straight to out[B, Hq, D]; otherwise each split writes
// its normalized partial to part_o[split, B, Hq, D] and (max, sum) to part_ml[split, B, Hq, 2].
extern "C" __global__ void __launch_bounds__(32)
paged_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
             const int* __restrict__ block_tables, const int* __restrict__ context_lens,
             bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
             int max_blocks_per_seq, int num_q_heads, int num_layers, int layer, int block_size,
             int block_shift, int num_kv_heads, int keys_per_split, float scale_log2) {
    extern __shared__ uint4 smem_u4[];
    bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_u4);
    bf16_t* sK0 = sQ + 16 * STRIDE;
    bf16_t* sV0 = sK0 + BN * STRIDE;
    bf16_t* sK1 = sV0 + BN * STRIDE;
    bf16_t* sV1 = sK1 + BN * STRIDE;

    const int lane = threadIdx.x;
    const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const int num_splits = gridDim.x, num_seqs = gridDim.z;
    const int group = num_q_heads / num_kv_heads;
    const int context_len = context_lens[seq];
    const int key_begin = split * keys_per_split;
    const int key_end = min(context_len, key_begin + keys_per_split);
    const long long row_base = (long long)seq * num_q_heads + kv_head * group;  // out row of head 0
    const long long part_base = (long long)split * num_seqs * num_q_heads + row_base;
    if (key_begin >= key_end) {  // this split lies past the context: an empty partial
        if (lane < group) {
            part_ml[(part_base + lane) * 2] = NEG_INF;
            part_ml[(part_base + lane) * 2 + 1] = 0.f;
        }
        return;
    }
    const Arena arena{kv, num_layers, layer, block_size, block_shift, num_kv_heads};
    const int* block_table = block_tables + (long long)seq * max_blocks_per_seq;

    for (int c = lane; c < 16 * CHUNKS; c += 32) {
        const int r = c / CHUNKS, ch = c % CHUNKS;
        const bool valid = r < group;
        const bf16_t* src = valid ? q + (row_base + r) * D + ch * 8 : q;
        cp_async16(sQ + r * STRIDE + ch * 8, src, valid);
    }
    const int num_key_tiles = (key_end - key_begin + BN - 1) / BN;
    load_kv_tile<BN>(sK0, sV0, arena, block_table, kv_head, key_begin, key_end, lane, 32);
    cp_async_commit();

    float m[1][2] = {{NEG_INF, NEG_INF}}, l[1][2] = {{0.f, 0.f}};
    float o[1][D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[0][nt][0] = o[0][nt][1] = o[0][nt][2] = o[0][nt][3] = 0.f;
    const int no_position[1][2] = {{NO_POSITION, NO_POSITION}};

    for (int j = 0; j < num_key_tiles; ++j) {
        const bool odd = j & 1;
        if (j + 1 < num_key_tiles) {
            load_kv_tile<BN>(odd ? sK0 : sK1, odd ? sV0 : sV1, arena, block_table, kv_head,
                             key_begin + (j + 1) * BN, key_end, lane, 32);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();
        const int key_base = key_begin + j * BN;
        const bf16_t* sK = odd ? sK1 : sK0;
        const bf16_t* sV = odd ? sV1 : sV0;
        if (key_base + BN > key_end)
            attend_tile<1, BN, true>(sQ, sK, sV, 0, key_base, key_end, no_position, scale_log2,
                                     m, l, o, lane);
        else
            attend_tile<1, BN, false>(sQ, sK, sV, 0, key_base, key_end, no_position, scale_log2,
                                      m, l, o, lane);
        __syncwarp();
    }

    float inv[2];
    finish_rows(l[0], inv);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = g + 8 * i;
        if (r >= group) continue;
        if (num_splits == 1) {
            bf16_t* dst = out + (row_base + r) * D + 2 * t;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt)
                *reinterpret_cast<unsigned*>(dst + nt * 8) =
                    pack_bf16x2(o[0][nt][2 * i] * inv[i], o[0][nt][2 * i + 1] * inv[i]);
        } else {
            float* dst = part_o + (part_base + r) * D + 2 * t;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                dst[nt * 8] = o[0][nt][2 * i] * inv[i];
                dst[nt * 8 + 1] = o[0][nt][2 * i + 1] * inv[i];
            }
            if (t == 0) {
                part_ml[(part_base + r) * 2] = m[0][i];
                part_ml[(part_base + r) * 2 + 1] = l[0][i];
            }
        }
    }
}

// One CTA per output row (sequence, query head): weights l_s * 2^(m_s - max m), empty splits skipped.
extern "C" __global__ void combine_splits(const float* __restrict__ part_o,
                                          const float* __restrict__ part_ml,
                                          bf16_t* __restrict__ out, int num_splits, int num_rows) {
    const int row = blockIdx.x;
    float max_m = NEG_INF;
    for (int s = 0; s < num_splits; ++s)
        max_m = fmaxf(max_m, part_ml[((long long)s * num_rows + row) * 2]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int s = 0; s < num_splits; ++s) {
            const long long idx = (long long)s * num_rows + row;
            const float m = part_ml[idx * 2];
            if (m == NEG_INF) continue;
            const float w = part_ml[idx * 2 + 1] * exp2f(m - max_m);
            num += w * part_o[idx * D + d];
            den += w;
        }
        out[(long long)row * D + d] = float_to_bf16(den > 0.f ? num / den : 0.f);
    }
}
