// Short prefill queries over long paged contexts, split over the context (flash-decoding style):
// cuDNN runs one partial attention per (sequence, context slice) with its log-sum-exp, and these
// kernels prepare its inputs and merge its outputs (kernels/cudnn_split.py drives them).
//
// Layout of the pseudo-sequences: n = b * S + j is slice j of sequence b (keys
// [j * L, min((j + 1) * L, P_b)), L = slice_blocks * block_size, unmasked), n = B * S + b is the
// tail of b (keys [P_b, context_len), causal bottom-right). P_b = the whole blocks before the
// sequence's first query row, so every query row sees every prefix key. Arrays indexed by n:
// q_lens, kv_lens [N = B * S + B]; q_rep / o_part [N, R, Hq, D] bf16; lse [N, Hq, R] float32.

#include "common.cuh"

// One thread per (sequence, table column): the prefix table [B, S * slice_blocks] (the block
// table padded with block 0), the tail table [B, tail_width] (the table from block P_b / bs on),
// and (columns < S, and column 0 for the tail) the lengths of each pseudo-sequence. An empty
// slice gets q_len 0 as well: cuDNN computes no row of it and the merge skips it.
extern "C" __global__ void split_meta(const int* __restrict__ cu_seqlens_q,
                                      const int* __restrict__ context_lens,
                                      const int* __restrict__ tables, int num_seqs,
                                      int table_width, int num_slices, int slice_blocks,
                                      int tail_width, int block_size, int* __restrict__ q_lens,
                                      int* __restrict__ kv_lens, int* __restrict__ prefix_table,
                                      int* __restrict__ tail_table) {
    const int prefix_cols = num_slices * slice_blocks;
    const int cols = prefix_cols + tail_width;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_seqs * cols) return;
    const int b = i / cols, c = i % cols;
    const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const int context_len = context_lens[b];
    const int prefix_blocks = max(context_len - q_len, 0) / block_size;
    const int prefix_len = prefix_blocks * block_size;
    const int* row = tables + (long long)b * table_width;
    if (c < prefix_cols) {
        prefix_table[(long long)b * prefix_cols + c] = c < table_width ? row[c] : 0;
    } else {
        const int src = prefix_blocks + (c - prefix_cols);
        tail_table[(long long)b * tail_width + (c - prefix_cols)] =
            src < table_width ? row[src] : 0;
    }
    if (c < num_slices) {
        const int slice_len = slice_blocks * block_size;
        const int len = min(max(prefix_len - c * slice_len, 0), slice_len);
        kv_lens[b * num_slices + c] = len;
        q_lens[b * num_slices + c] = len > 0 ? q_len : 0;
    }
    if (c == 0) {
        kv_lens[num_seqs * num_slices + b] = context_len - prefix_len;
        q_lens[num_seqs * num_slices + b] = q_len;
    }
}

// One thread per 16 bytes of a query row of a pseudo-sequence: q_rep[n, i] = q[cu[b] + i] for
// i < q_lens[n] (rows past it are left as they are: cuDNN masks them).
extern "C" __global__ void replicate_q(const uint4* __restrict__ q,
                                       const int* __restrict__ cu_seqlens_q,
                                       const int* __restrict__ q_lens, uint4* __restrict__ q_rep,
                                       int num_seqs, int num_slices, int max_rows,
                                       int row_words) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int num_pseudo = num_seqs * num_slices + num_seqs;
    if (i >= (long long)num_pseudo * max_rows * row_words) return;
    const int word = (int)(i % row_words);
    const int r = (int)((i / row_words) % max_rows);
    const int n = (int)(i / ((long long)row_words * max_rows));
    if (r >= q_lens[n]) return;
    const int b = n < num_seqs * num_slices ? n / num_slices : n - num_seqs * num_slices;
    q_rep[i] = q[((long long)cu_seqlens_q[b] + r) * row_words + word];
}

// One thread per (query row, head, 8 dims) of the output: the partials of the sequence's
// non-empty slices and its tail, weighted by exp(lse - max) (natural log, as cuDNN's stats).
extern "C" __global__ void merge_partials(const uint4* __restrict__ o_part,
                                          const float* __restrict__ lse,
                                          const int* __restrict__ cu_seqlens_q,
                                          const int* __restrict__ kv_lens,
                                          uint4* __restrict__ out, int num_seqs, int num_slices,
                                          int max_rows, int num_heads, int head_words) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_seqs * max_rows * num_heads * head_words) return;
    const int word = (int)(i % head_words);
    const int h = (int)((i / head_words) % num_heads);
    const int r = (int)((i / ((long long)head_words * num_heads)) % max_rows);
    const int b = (int)(i / ((long long)head_words * num_heads * max_rows));
    const int start = cu_seqlens_q[b];
    if (r >= cu_seqlens_q[b + 1] - start) return;
    float m = __int_as_float(0xff800000), denom = 0.f;  // m starts at -inf
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j <= num_slices; ++j) {
        const int n = j < num_slices ? b * num_slices + j : num_seqs * num_slices + b;
        if (kv_lens[n] == 0) continue;
        const float l = lse[((long long)n * num_heads + h) * max_rows + r];
        const float m_new = fmaxf(m, l);
        const float keep = __expf(m - m_new), w = __expf(l - m_new);
        float f[8];
        unpack8(o_part[(((long long)n * max_rows + r) * num_heads + h) * head_words + word], f);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = acc[k] * keep + w * f[k];
        denom = denom * keep + w;
        m = m_new;
    }
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] *= inv;
    out[(((long long)start + r) * num_heads + h) * head_words + word] = pack8(acc);
}
