// Gather/scatter of whole KV blocks: one launch moves a batch of runs, run r copying num_bytes[r]
// (a multiple of 16) from src_ptrs[r] to dst_ptrs[r]. Pointers may be device addresses or pinned
// host addresses (unified addressing), so the same kernel saves (HBM -> pinned), loads
// (pinned -> HBM) and copies between two engines' arenas (the store's HBM tier: one launch per
// batch instead of one cudaMemcpyAsync per block, whose ~5 us call cost dwarfs a 2 MB copy at HBM
// speed). The launcher checks alignment. blockIdx.y picks the run, blockIdx.x/threadIdx.x stride
// over its 16-byte words.

extern "C" __global__ void copy_runs(const unsigned long long* __restrict__ src_ptrs,
                                     const unsigned long long* __restrict__ dst_ptrs,
                                     const long long* __restrict__ num_bytes) {
    const int run = blockIdx.y;
    const uint4* src = reinterpret_cast<const uint4*>(src_ptrs[run]);
    uint4* dst = reinterpret_cast<uint4*>(dst_ptrs[run]);
    const long long num_words = num_bytes[run] / 16;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // Four independent loads in flight per thread: PCIe latency needs many outstanding requests.
    for (; i + 3 * stride < num_words; i += 4 * stride) {
        uint4 a = src[i];
        uint4 b = src[i + stride];
        uint4 c = src[i + 2 * stride];
        uint4 d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < num_words; i += stride) dst[i] = src[i];
}
