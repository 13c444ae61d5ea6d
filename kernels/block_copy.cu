// Gather/scatter of whole KV blocks: one launch moves a batch of runs, run r copying sizes[r]
// bytes (a multiple of 16) from srcs[r] to dsts[r]. Pointers may be device addresses or pinned
// host addresses (unified addressing), so the same kernel saves (HBM -> pinned), loads
// (pinned -> HBM) and copies between two engines' arenas (the store's HBM tier: one launch per
// batch instead of one cudaMemcpyAsync per piece, whose ~5 us call cost dwarfs a 32 KiB copy).
//
// table is int64[3][num_runs] (srcs, dsts, sizes) and may itself live in mapped pinned memory:
// each CTA reads its run's three words once. CTA b copies part b % BLOCKS_PER_RUN of run
// b / BLOCKS_PER_RUN (a 1-D grid: no 65,535 cap on the number of runs). UNROLL independent
// 16-byte loads are in flight per thread before any store: reads over PCIe (loads) need many
// outstanding requests to cover the bus latency. The launcher checks alignment.

#ifndef UNROLL
#define UNROLL 4
#endif

extern "C" __global__ void copy_runs(const long long* __restrict__ table, long long num_runs,
                                     int blocks_per_run) {
    const long long run = blockIdx.x / blocks_per_run;
    const int part = blockIdx.x % blocks_per_run;
    const uint4* src = reinterpret_cast<const uint4*>(table[run]);
    uint4* dst = reinterpret_cast<uint4*>(table[num_runs + run]);
    const long long num_words = table[2 * num_runs + run] / 16;
    const long long stride = (long long)blocks_per_run * blockDim.x;
    long long i = (long long)part * blockDim.x + threadIdx.x;
    // Every pass issues up to UNROLL loads before its first store, the last (partial) pass too:
    // a 32 KiB piece is one pass of two CTAs at UNROLL 4.
    for (; i < num_words; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (i + u * stride < num_words) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (i + u * stride < num_words) dst[i + u * stride] = v[u];
    }
}

// Packing the pieces of whole blocks: block j of a batch occupies bytes [j * block_bytes,
// (j + 1) * block_bytes) of the packed buffer, its pieces in region order (the store's layout
// of a block), and its piece of region r lives in the engine at
// regions[r] + blocks[j] * regions[R + r] (regions: int64[4][R]: block 0's piece address, the
// stride between blocks, the piece size, the piece's offset inside a packed block). pack = 1
// gathers engine -> packed (a save), 0 scatters packed -> engine (a load). The per-batch table
// is just the block ids (int64[num_blocks], may live in mapped pinned memory): a launch does not
// need a run per piece (vLLM's layout: 72 per block). CTA b copies part b % blocks_per_piece of
// piece b / blocks_per_piece (piece p: block p / R, region p % R), as copy_runs does.
// slots (int64[num_blocks], or null): block j goes to packed position slots[j] instead of j (a
// staging buffer whose free slots are not consecutive). A grid of fewer than num_pieces *
// blocks_per_piece CTAs (a whole multiple of blocks_per_piece) loops over the pieces: a pack
// beside an engine's compute takes a few SMs, not all of them.
extern "C" __global__ void copy_pieces(const long long* __restrict__ regions, int num_regions,
                                       const long long* __restrict__ blocks,
                                       const long long* __restrict__ slots, char* packed,
                                       long long block_bytes, int blocks_per_piece, int pack,
                                       long long num_pieces) {
    const int part = blockIdx.x % blocks_per_piece;
    const long long pieces_per_pass = gridDim.x / blocks_per_piece;
    // A grid smaller than num_pieces * blocks_per_piece (a capped launch) loops over pieces.
    for (long long piece = blockIdx.x / blocks_per_piece; piece < num_pieces;
         piece += pieces_per_pass) {
        const long long j = piece / num_regions;
        const int r = (int)(piece % num_regions);
        const long long at = slots ? slots[j] : j;
        char* engine = reinterpret_cast<char*>(regions[r] + blocks[j] * regions[num_regions + r]);
        char* host_side = packed + at * block_bytes + regions[3 * num_regions + r];
        const uint4* src = reinterpret_cast<const uint4*>(pack ? engine : host_side);
        uint4* dst = reinterpret_cast<uint4*>(pack ? host_side : engine);
        const long long num_words = regions[2 * num_regions + r] / 16;
        const long long stride = (long long)blocks_per_piece * blockDim.x;
        long long i = (long long)part * blockDim.x + threadIdx.x;
        for (; i < num_words; i += UNROLL * stride) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (i + u * stride < num_words) v[u] = src[i + u * stride];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (i + u * stride < num_words) dst[i + u * stride] = v[u];
        }
    }
}
