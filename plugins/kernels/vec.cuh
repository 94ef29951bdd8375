// Vectorized global loads and stores of 8 elements (one 16-byte fp16/bf16 vector), shared by the kernels.
//
// The element conversions themselves live in cache_convert.cuh (toFloat / fromFloat / quantizeElem): these
// helpers only move 8 converted elements between registers and memory in one access, so that a warp touches
// whole 32-byte sectors (16 B per lane for fp16/bf16, 8 B per lane for the 1-byte cache types).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cache_convert.cuh"

namespace pagedkv {

constexpr int32_t kVecElems = 8;  // elements per vector access (16 B of fp16/bf16)

// Raw bits of 8 elements of type T: 16 B for 2-byte types, 8 B for 1-byte types.
template <typename T>
struct VecBits;
template <>
struct VecBits<__half> {
    using type = uint4;
};
template <>
struct VecBits<__nv_bfloat16> {
    using type = uint4;
};
template <>
struct VecBits<__nv_fp8_storage_t> {
    using type = uint2;
};
template <>
struct VecBits<int8_t> {
    using type = uint2;
};
template <typename T>
using vec_bits_t = typename VecBits<T>::type;

// 16-byte load of data read exactly once (the packed QKV rows): streaming, evict-first, so it does not push
// the block tables and the bias out of L1/L2.
__device__ __forceinline__ uint4 loadStreaming16(void const* p) { return __ldcs(reinterpret_cast<uint4 const*>(p)); }

// Asynchronous 16-byte copy global -> shared (sm_80+: cp.async.cg, cached in L2 only, like a streaming load),
// zero-filling the 16 bytes instead when !valid (then `src` is not read). Unlike a register load, a copy in
// flight holds no register: a ring of them in shared memory can be indexed with a runtime slot, so a loop that
// is not unrolled still keeps several loads in flight (a rotating register array in such a loop needs moves,
// and a move waits for its load to land: the prefetch depth collapses to one). Completion is per thread:
// commitAsyncCopies() closes a group, waitAsyncCopies<N>() waits until at most N of the thread's groups are
// pending; the thread may then read what its own copies wrote, with no barrier.
__device__ __forceinline__ void copyAsync16(void* dst, void const* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    *static_cast<uint4*>(dst) = valid ? loadStreaming16(src) : make_uint4(0, 0, 0, 0);  // synchronous
#else
    uint32_t const dstShared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    int32_t const srcBytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dstShared), "l"(src), "r"(srcBytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void commitAsyncCopies() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kPendingGroups>
__device__ __forceinline__ void waitAsyncCopies() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups) : "memory");
#endif
}

// 16-byte load of small read-only data reused across tokens (the bias row).
__device__ __forceinline__ uint4 loadReadOnly16(void const* p) { return __ldg(reinterpret_cast<uint4 const*>(p)); }

// 8 activation elements (fp16/bf16 bits) -> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(uint4 bits, float (&out)[kVecElems]) {
    T elems[kVecElems];
    static_assert(sizeof(elems) == sizeof(uint4), "8 two-byte elements per 16-byte vector");
    __builtin_memcpy(elems, &bits, sizeof(bits));
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) out[k] = toFloat<T>(elems[k]);
}
// bf16 is the top half of a float: a shift or a mask per element, 8 instructions per vector (the generic path's
// half extraction + shift was 12, on every pass of the write kernel, twice with NeoX partners). Exact, as before.
template <>
__device__ __forceinline__ void unpack8<__nv_bfloat16>(uint4 bits, float (&out)[kVecElems]) {
    uint32_t const words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[2 * k] = __uint_as_float(words[k] << 16);              // element 2k: the low half
        out[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);  // element 2k + 1: the high half
    }
}

// x[k] += bias[k] for 8 activation elements loaded with one 16-byte read-only load.
template <typename T>
__device__ __forceinline__ void addBias8(float (&x)[kVecElems], T const* bias) {
    float b[kVecElems];
    unpack8<T>(loadReadOnly16(bias), b);
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) x[k] += b[k];
}

// One 16- or 8-byte store to global memory (`dst` aligned to its size), written in PTX: as a C++ assignment it
// came out as four 4-byte stores in the one-token write kernel, whose q / K / V stores the compiler merges into one
// site and then no longer proves aligned. No "memory" clobber: nothing the kernels read aliases what they store
// through it (q and the pool's new rows), so loads and stores may still be moved across it.
__device__ __forceinline__ void storeGlobal(void* dst, uint4 bits) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(__cvta_generic_to_global(dst)), "r"(bits.x),
                 "r"(bits.y), "r"(bits.z), "r"(bits.w));
}
__device__ __forceinline__ void storeGlobal(void* dst, uint2 bits) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(__cvta_generic_to_global(dst)), "r"(bits.x), "r"(bits.y));
}

// Stores 8 already-converted elements with one access (16 B or 8 B). `dst` must be aligned to that size.
template <typename T>
__device__ __forceinline__ void storeVec8(T* dst, T const (&elems)[kVecElems]) {
    vec_bits_t<T> bits;
    static_assert(sizeof(bits) == sizeof(elems), "vector bits hold exactly 8 elements");
    __builtin_memcpy(&bits, elems, sizeof(bits));
    storeGlobal(dst, bits);
}

// 8 floats -> 8 activation elements (round to nearest even, cache_convert.cuh's fromFloat), one store.
template <typename T>
__device__ __forceinline__ void storeActivation8(T* dst, float const (&x)[kVecElems]) {
    T elems[kVecElems];
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) elems[k] = fromFloat<T>(x[k]);
    storeVec8(dst, elems);
}

// 8 floats -> 8 stored cache elements of dtype D (cache_convert.cuh's quantizeElem with 1/scale), one store.
template <CacheDType D>
__device__ __forceinline__ void storeQuantized8(cache_t<D>* dst, float const (&x)[kVecElems], float invScale) {
    cache_t<D> elems[kVecElems];
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) elems[k] = quantizeElem<D>(x[k], invScale);
    storeVec8(dst, elems);
}

// 8 zero elements of dtype D (all-zero bits is +0 in every supported cache dtype).
template <CacheDType D>
__device__ __forceinline__ void storeZero8(cache_t<D>* dst) {
    storeGlobal(dst, vec_bits_t<cache_t<D>>{});
}

}  // namespace pagedkv
