// Vectorized conversion of 8-bit stored values (fp8 e4m3, int8) to the 16-bit compute type of the tensor
// cores, for the attention read side. The conversion is exact and applies NO scale: the cache's k/v scales
// (and the fp8 query scale) are folded into the softmax scale and the output scale by the launcher, so
// x = stored * scale (plugins/kernels/cache_convert.cuh) holds for the result as a whole.
//
// fp8 -> 16-bit with integer ops only (PRMT + shift + LOP3 per pair, then one exact power-of-two multiply):
// moving the e4m3 bits (s eeee mmm) into the f16 (bf16) bit positions yields the value times 2^-8 (2^-120),
// subnormals included, because the exponent field is copied verbatim; multiplying by 2^8 (2^120) in the
// same type restores it exactly (f16/bf16 arithmetic keeps subnormal inputs). The e4m3 NaN codes 0x7f/0xff
// become +-480, which never matters: pool rows past a sequence or on absent pages are never loaded, and the
// write side saturates to +-448.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention_mma.cuh"

namespace pagedkv {
namespace attn {

template <typename CT>
struct Fp8Bits;

template <>
struct Fp8Bits<__half> {
    // 16-bit lane w = byte << 8: keep the sign, shift "eeee mmm" down by one to the f16 exponent position.
    static __device__ __forceinline__ uint32_t pair(uint32_t spread) {
        uint32_t r = (spread & 0x80008000u) | ((spread >> 1) & 0x3F803F80u);
        __half2 h = *reinterpret_cast<__half2*>(&r);
        h = __hmul2(h, __floats2half2_rn(256.f, 256.f));
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

template <>
struct Fp8Bits<__nv_bfloat16> {
    // shift "eeee mmm" down by four to the bf16 exponent position; bf16 2^120 is 0x7B80.
    static __device__ __forceinline__ uint32_t pair(uint32_t spread) {
        uint32_t r = (spread & 0x80008000u) | ((spread >> 4) & 0x07F007F0u);
        __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&r);
        uint32_t scaleBits = 0x7B807B80u;
        h = __hmul2(h, *reinterpret_cast<__nv_bfloat162*>(&scaleBits));
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

// Four e4m3 bytes (byte 0 first) -> two packed pairs of the compute type.
template <typename CT>
__device__ __forceinline__ void fp8x4ToPairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
    lo = Fp8Bits<CT>::pair(__byte_perm(x, 0u, 0x1404));  // bytes [b1 0 b0 0]
    hi = Fp8Bits<CT>::pair(__byte_perm(x, 0u, 0x3424));  // bytes [b3 0 b2 0]
}

// Four int8 -> two packed pairs (|x| <= 128 is exact in f16 and bf16).
template <typename CT>
__device__ __forceinline__ void int8x4ToPairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
    int32_t v = static_cast<int32_t>(x);
    float f0 = static_cast<float>((v << 24) >> 24);
    float f1 = static_cast<float>((v << 16) >> 24);
    float f2 = static_cast<float>((v << 8) >> 24);
    float f3 = static_cast<float>(v >> 24);
    lo = Mma<CT>::pack(f0, f1);
    hi = Mma<CT>::pack(f2, f3);
}

// Eight 8-bit stored values -> eight compute-type values (one 16-byte chunk). `isFp8` is uniform per launch.
template <typename CT>
__device__ __forceinline__ uint4 dequant8x8(uint2 raw, bool isFp8) {
    uint4 out;
    if (isFp8) {
        fp8x4ToPairs<CT>(raw.x, out.x, out.y);
        fp8x4ToPairs<CT>(raw.y, out.z, out.w);
    } else {
        int8x4ToPairs<CT>(raw.x, out.x, out.y);
        int8x4ToPairs<CT>(raw.y, out.z, out.w);
    }
    return out;
}

}  // namespace attn
}  // namespace pagedkv
