// TMA loads of K/V rows for the Hopper multi-token kernel: a tensor map over every K and V row of the pool, completed
// on the device (the pool's address is device data: the step's pool descriptor), and the copies that use it.
//
// The map. In the HND page layout ([KVH, P, D] per (block, layer, K|V)) every row of D elements starts a whole number
// of rows from the pool's base: each stride of the layout is a multiple of strideToken = D. So the pool is one 2-D
// tensor {D, rows} of 16-bit elements with a row pitch of 2 D bytes, and a run of 16 consecutive rows of one page (a
// producer warp's half tile, attention_multi_sm90.cuh) is one box {64, 16} per 64-column block, its rows landing 128
// bytes apart in 128-byte-swizzled order -- the blocked tile wgmma reads (chunk ^ (row & 7), blocks on 1024-byte
// boundaries: sm90/wgmma.cuh). The host encodes a template (kvRowMapTemplate: element type, rank, pitch, box,
// swizzle; a placeholder address and row count), passed as a __grid_constant__ parameter; each CTA copies it into
// shared memory, writes the pool's base and row count into it (tensormap.replace) and publishes it to its own slot of
// the workspace's map region (tensormap.cp_fenceproxy, release), and every thread that issues copies acquires it
// first (fence.proxy.tensormap::generic). A slot per CTA: no two CTAs write one slot, so nothing races, and each
// slot is written before it is read in every launch (nothing to reset).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda/ptx>

#include <cstdint>

namespace pagedkv {
namespace attn {
namespace tma {

constexpr int kBoxCols = 64;  // elements: one 128-byte column block of the blocked tiles
constexpr int kBoxRows = 16;  // a producer warp's half tile

#if defined(__CUDACC__)
// The calling warp (all 32 lanes) completes `tmpl` for the pool at `base` with `rows` rows and publishes it to
// `slot`, through `scratch` (128 bytes of this CTA's shared memory, 128-byte aligned). Every thread that issues
// copies through the map acquires it (acquireMap) after a barrier with this warp.
__device__ __forceinline__ void publishMap(CUtensorMap const& tmpl, void* scratch, CUtensorMap* slot,
                                           void const* base, uint32_t rows, int32_t lane) {
    namespace ptx = cuda::ptx;
    reinterpret_cast<uint32_t*>(scratch)[lane] = reinterpret_cast<uint32_t const*>(&tmpl)[lane];
    __syncwarp();
    if (lane == 0) {
        ptx::tensormap_replace_global_address(ptx::space_shared, scratch, reinterpret_cast<uint64_t>(base));
        ptx::tensormap_replace_global_dim(ptx::space_shared, scratch, ptx::n32_t<1>{}, rows);
    }
    __syncwarp();
    ptx::tensormap_cp_fenceproxy(ptx::sem_release, ptx::scope_gpu, slot, scratch, ptx::n32_t<128>{});
}

__device__ __forceinline__ void acquireMap(CUtensorMap const* slot) {
    namespace ptx = cuda::ptx;
    ptx::fence_proxy_tensormap_generic(ptx::sem_acquire, ptx::scope_gpu, slot, ptx::n32_t<128>{});
}

// The full barrier of a stage expects `bytes` more from copies that complete on it (one thread, before its copies).
__device__ __forceinline__ void expectBytes(uint64_t* bar, uint32_t bytes) {
    namespace ptx = cuda::ptx;
    ptx::mbarrier_expect_tx(ptx::sem_relaxed, ptx::scope_cta, ptx::space_shared, bar, bytes);
}

// Rows [row, row + 16) of columns [col, col + 64) into `dst` (a 2048-byte block of 16 swizzled 128-byte rows);
// completes `bytes` = 2048 on `bar`.
__device__ __forceinline__ void loadBox(void* dst, CUtensorMap const* map, int32_t col, int32_t row, uint64_t* bar) {
    namespace ptx = cuda::ptx;
    int32_t const coords[2] = {col, row};
    ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, dst, map, coords, bar);
}
#endif

}  // namespace tma
}  // namespace attn
}  // namespace pagedkv
