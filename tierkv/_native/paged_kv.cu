// tierkv paged KV gather/scatter: one launch moves many blocks, all layers, K and V.
//
// An engine keeps KV per layer in paged caches, K and V each [num_blocks, block_tokens, heads, head_dim]
// ("NHD", vLLM) or [num_blocks, heads, block_tokens, head_dim] ("HND", flash-attn style); tierkv keeps a
// block contiguous as [2, layers, heads, block_tokens, head_dim]. The kernel does not know the layout: the
// host passes the engine strides of (block, token, head) in words, so NHD, HND and padded caches (vLLM's
// [num_blocks, 2, ...] per-layer tensors) share one code path.
//
// Grid: blockIdx.x = one (tierkv block i, kv, layer) chunk of heads*tokens*head_dim elements, which is
// contiguous on the tierkv side; blockIdx.y splits a chunk's rows. Threads: x = word within a row,
// y = row. The copy unit W is the widest word
// (16/8/4/2/1 bytes) that divides every address and stride, chosen on the host (tierkv/paged.py).
//
// The same source is compiled three ways:
//   * NVRTC (cupy.RawModule): no includes, kernels are extern "C".
//   * nvcc through torch.utils.cpp_extension.load_inline, with -DTIERKV_TORCH_EXTENSION: adds a launcher.
//   * g++ with -DTIERKV_HOST_EMULATION: a serial host loop runs the kernel body, so CI without a GPU
//     checks this file's index math against the torch reference (tests/client/test_paged.py).
//
// Addresses are passed as 64-bit integers and cast here: cupy packs numpy scalars by size, and host
// memory registered with CUDA (cudaHostRegister, pinned slots) is addressed by its host pointer under UVA.

#ifdef TIERKV_HOST_EMULATION
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
struct tkv_dim3 { unsigned int x, y, z; };
static tkv_dim3 blockIdx, threadIdx, blockDim, gridDim;
#endif

typedef unsigned long long tkv_u64;
typedef long long tkv_i64;

struct alignas(16) tkv_w16 { tkv_u64 lo, hi; };

// Rows (one head_dim vector) each thread keeps in flight per loop trip: all loads, then all stores.
#define TKV_UNROLL 4

// Threads are 2-D: x walks the words of one row (head_dim), y walks rows (head, token) of the chunk. A
// thread's (head, token) advances by a fixed stride, carried by hand, so the loop does no division: 64-bit
// division per word would make this copy compute-bound.
template <typename W>
__device__ __forceinline__ void tkv_paged_copy(
    tkv_u64 layer_ptrs_addr,   // device array of 2*L engine cache base addresses: K layers, then V layers
    tkv_u64 block_ids_addr,    // device array of n int64 engine block ids
    tkv_u64 blk_ptrs_addr,     // device array of n tierkv block addresses, or 0: blk_base + i * blk_stride
    tkv_u64 blk_base, tkv_i64 blk_stride,  // bytes
    tkv_i64 n, tkv_i64 L, tkv_i64 H, tkv_i64 T, tkv_i64 Dw,
    tkv_i64 s_blk, tkv_i64 s_tok, tkv_i64 s_head,  // engine strides in words
    tkv_i64 num_engine_blocks, tkv_i64 to_engine) {
    const tkv_u64* __restrict__ layer_ptrs = reinterpret_cast<const tkv_u64*>(layer_ptrs_addr);
    const tkv_i64* __restrict__ block_ids = reinterpret_cast<const tkv_i64*>(block_ids_addr);
    const tkv_u64* __restrict__ blk_ptrs = reinterpret_cast<const tkv_u64*>(blk_ptrs_addr);

    const tkv_i64 chunk = static_cast<tkv_i64>(blockIdx.x);  // = i * 2L + kv * L + layer
    const tkv_i64 per_block = 2 * L;
    if (chunk >= n * per_block) return;
    const tkv_i64 i = chunk / per_block;
    const tkv_i64 r = chunk - i * per_block;  // kv * L + layer: index into layer_ptrs and into the block
    const tkv_i64 bid = block_ids[i];
    if (bid < 0 || bid >= num_engine_blocks) return;  // validated on the host; never write out of bounds

    const tkv_i64 rows = H * T;
    W* tier = reinterpret_cast<W*>(blk_ptrs ? blk_ptrs[i] : blk_base + static_cast<tkv_u64>(i * blk_stride));
    tier += r * rows * Dw;
    W* eng = reinterpret_cast<W*>(layer_ptrs[r]) + bid * s_blk;

    const tkv_i64 row0 = static_cast<tkv_i64>(blockIdx.y) * blockDim.y + threadIdx.y;
    const tkv_i64 step = static_cast<tkv_i64>(gridDim.y) * blockDim.y;  // rows between a thread's rows
    const tkv_i64 step_h = step / T;
    const tkv_i64 step_t = step - step_h * T;
    for (tkv_i64 d = threadIdx.x; d < Dw; d += blockDim.x) {
        tkv_i64 h = row0 / T;
        tkv_i64 t = row0 - h * T;
        for (tkv_i64 row = row0; row < rows; row += step * TKV_UNROLL) {
            tkv_i64 eng_off[TKV_UNROLL];
            W val[TKV_UNROLL];
#pragma unroll
            for (int u = 0; u < TKV_UNROLL; ++u) {
                eng_off[u] = t * s_tok + h * s_head + d;
                h += step_h;
                t += step_t;
                if (t >= T) { t -= T; ++h; }
            }
            if (to_engine) {
#pragma unroll
                for (int u = 0; u < TKV_UNROLL; ++u)
                    if (row + u * step < rows) val[u] = tier[(row + u * step) * Dw + d];
#pragma unroll
                for (int u = 0; u < TKV_UNROLL; ++u)
                    if (row + u * step < rows) eng[eng_off[u]] = val[u];
            } else {
#pragma unroll
                for (int u = 0; u < TKV_UNROLL; ++u)
                    if (row + u * step < rows) val[u] = eng[eng_off[u]];
#pragma unroll
                for (int u = 0; u < TKV_UNROLL; ++u)
                    if (row + u * step < rows) tier[(row + u * step) * Dw + d] = val[u];
            }
        }
    }
}

#define TKV_PARAMS                                                                                      \
    tkv_u64 layer_ptrs_addr, tkv_u64 block_ids_addr, tkv_u64 blk_ptrs_addr, tkv_u64 blk_base,            \
        tkv_i64 blk_stride, tkv_i64 n, tkv_i64 L, tkv_i64 H, tkv_i64 T, tkv_i64 Dw, tkv_i64 s_blk,         \
        tkv_i64 s_tok, tkv_i64 s_head, tkv_i64 num_engine_blocks, tkv_i64 to_engine
#define TKV_ARGS                                                                                        \
    layer_ptrs_addr, block_ids_addr, blk_ptrs_addr, blk_base, blk_stride, n, L, H, T, Dw, s_blk, s_tok,  \
        s_head, num_engine_blocks, to_engine

extern "C" __global__ void tierkv_paged_copy_16(TKV_PARAMS) { tkv_paged_copy<tkv_w16>(TKV_ARGS); }
extern "C" __global__ void tierkv_paged_copy_8(TKV_PARAMS) { tkv_paged_copy<tkv_u64>(TKV_ARGS); }
extern "C" __global__ void tierkv_paged_copy_4(TKV_PARAMS) { tkv_paged_copy<unsigned int>(TKV_ARGS); }
extern "C" __global__ void tierkv_paged_copy_2(TKV_PARAMS) { tkv_paged_copy<unsigned short>(TKV_ARGS); }
extern "C" __global__ void tierkv_paged_copy_1(TKV_PARAMS) { tkv_paged_copy<unsigned char>(TKV_ARGS); }

#if defined(TIERKV_TORCH_EXTENSION) || defined(TIERKV_HOST_EMULATION)
typedef void (*tkv_kernel_fn)(TKV_PARAMS);

static tkv_kernel_fn tkv_pick(long long word) {
    switch (word) {
        case 16: return tierkv_paged_copy_16;
        case 8: return tierkv_paged_copy_8;
        case 4: return tierkv_paged_copy_4;
        case 2: return tierkv_paged_copy_2;
        case 1: return tierkv_paged_copy_1;
        default: return 0;
    }
}
#endif

#ifdef TIERKV_TORCH_EXTENSION
#include <cstdint>
#include <stdexcept>
#include <string>
#include <cuda_runtime.h>

// Called from Python (bound by load_inline); every argument is an int so the binding needs no torch types.
void tierkv_paged_launch(int64_t word, int64_t grid_x, int64_t grid_y, int64_t block_x, int64_t block_y,
                         int64_t stream,
                         int64_t layer_ptrs_addr, int64_t block_ids_addr, int64_t blk_ptrs_addr,
                         int64_t blk_base, int64_t blk_stride, int64_t n, int64_t L, int64_t H, int64_t T,
                         int64_t Dw, int64_t s_blk, int64_t s_tok, int64_t s_head, int64_t num_engine_blocks,
                         int64_t to_engine) {
    tkv_kernel_fn fn = tkv_pick(word);
    if (!fn) throw std::invalid_argument("tierkv_paged_launch: bad word size");
    dim3 grid(static_cast<unsigned int>(grid_x), static_cast<unsigned int>(grid_y));
    dim3 block(static_cast<unsigned int>(block_x), static_cast<unsigned int>(block_y));
    fn<<<grid, block, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        (tkv_u64)layer_ptrs_addr, (tkv_u64)block_ids_addr, (tkv_u64)blk_ptrs_addr, (tkv_u64)blk_base,
        blk_stride, n, L, H, T, Dw, s_blk, s_tok, s_head, num_engine_blocks, to_engine);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw std::runtime_error(std::string("tierkv_paged_launch: ") + cudaGetErrorString(err));
}
#endif

#ifdef TIERKV_HOST_EMULATION
// Runs every (block, thread) of the launch in order. Valid because the kernel shares nothing between threads.
extern "C" int tierkv_paged_emulate(long long word, long long grid_x, long long grid_y, long long block_x,
                                    long long block_y, TKV_PARAMS) {
    tkv_kernel_fn fn = tkv_pick(word);
    if (!fn) return -1;
    gridDim.x = (unsigned int)grid_x; gridDim.y = (unsigned int)grid_y; gridDim.z = 1;
    blockDim.x = (unsigned int)block_x; blockDim.y = (unsigned int)block_y; blockDim.z = 1;
    for (long long by = 0; by < grid_y; ++by)
        for (long long bx = 0; bx < grid_x; ++bx)
            for (long long ty = 0; ty < block_y; ++ty)
                for (long long tx = 0; tx < block_x; ++tx) {
                    blockIdx.x = (unsigned int)bx; blockIdx.y = (unsigned int)by; blockIdx.z = 0;
                    threadIdx.x = (unsigned int)tx; threadIdx.y = (unsigned int)ty; threadIdx.z = 0;
                    fn(TKV_ARGS);
                }
    return 0;
}
#endif
