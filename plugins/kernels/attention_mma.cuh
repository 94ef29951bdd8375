// Warp-level tensor-core and async-copy primitives used by the attention kernels (sm_80+).
//
// mma.sync.m16n8k16 (f32 accumulate) fragment layouts, g = lane / 4, c = lane % 4 (PTX ISA "Matrix Fragments
// for mma.m16n8k16 with floating point type"):
//   A 16x16 (row):  a[0] = A[g][2c..2c+1]    a[1] = A[g+8][2c..2c+1]
//                   a[2] = A[g][2c+8..2c+9]  a[3] = A[g+8][2c+8..2c+9]
//   B 16x8 (col):   b[0] = B[2c..2c+1][g]    b[1] = B[2c+8..2c+9][g]
//   C 16x8:         c[0..1] = C[g][2c..2c+1] c[2..3] = C[g+8][2c..2c+1]
// Two adjacent C tiles (16x16) therefore are exactly the A fragment of the next product, which is how the
// probabilities P = softmax(S) feed P*V without any shuffle.
//
// Shared-memory tiles of 16-bit values are stored row-major with a power of two >= 64 elements per row (D, or
// the next such width: tileRowElems in attention_schedule.h), the 16-byte chunk `ch` of row `r` at chunk
// position ch ^ (r & 7): eight consecutive rows then hit eight different 16-byte bank groups, so ldmatrix (8
// rows of 16 bytes per phase) is conflict-free, and the two chunks of an aligned 32-byte pair stay one pair.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace pagedkv {
namespace attn {

__device__ __forceinline__ uint32_t smemAddr(void const* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of (row, 16-byte chunk) in a swizzled tile whose rows hold `rowBytes` bytes.
__device__ __forceinline__ uint32_t swizzledChunk(int32_t row, int32_t chunk, int32_t rowBytes) {
    return uint32_t(row * rowBytes + ((chunk ^ (row & 7)) << 4));
}

// ---- cp.async (L2 only: the KV stream is read once)
// .L2::128B is a prefetch-size hint: on a miss, L2 may fetch the whole 128-byte line from DRAM rather than the
// requested sectors (FlashInfer's loads ask the same). Measured on the H200, decode bf16 64 x 4K (P64): 262.2 ->
// 256.0 us, 4.10 -> 4.19 TB/s; .L2::256B was slower (272.9 us) and an evict-first policy on top of 128B too
// (268.3 us), neither profiled further (benchmarks/NOTES-attention.md).
__device__ __forceinline__ void cpAsync16(uint32_t dst, void const* src, bool valid) {
    // src-size 0 writes 16 zero bytes and reads nothing.
    int32_t srcBytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(srcBytes));
}
__device__ __forceinline__ void cpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cpAsyncWait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- ldmatrix: four 8x8 matrices of 16-bit values; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrixX4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- plain shared loads, volatile like ldmatrix so that they stay ordered after the cp.async wait and the
// warp barrier that publish the tile (the asm above carry no memory clobber).
__device__ __forceinline__ uint4 ldsU32x4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint2 ldsU32x2(uint32_t addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}

// ---- per compute type: the MMA and packing of two floats into one 32-bit register (low half = first)
template <typename CT>
struct Mma;

template <>
struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

template <>
struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

// 2^x (ex2.approx: relative error ~2^-22; exp2(-inf) = +0, which masking relies on).
__device__ __forceinline__ float fastExp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float negInf() { return __int_as_float(0xff800000u); }

}  // namespace attn
}  // namespace pagedkv
