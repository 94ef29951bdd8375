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
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

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

// ---- conversions straight into MMA fragments (decode kernel, 8-bit caches; kFp8: e4m3, else int8)
// Hardware e4m3 -> f16 (sm_89+): cvt.rn.f16x2.e4m3x2 turns the two bytes of a 16-bit value into an f16 pair,
// the low byte into the low half. Exact: every e4m3 value (subnormals included, |x| <= 448) is an f16. (The
// NaN codes 0x7f/0xff become NaN here, not +-480 as above; written rows never hold them: the write side
// saturates, and rows past a sequence or on absent pages are never loaded.)
// Below sm_89 (the sm_80 build) there is no such instruction: cuda_fp8.h's conversion computes the same
// exact pairs in software there.
__device__ __forceinline__ void e4m3x4ToHalfPairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n"
        "  .reg .b16 l, h;\n"
        "  mov.b32 {l, h}, %2;\n"
        "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
        "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
        "}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
#else
    __half2_raw const l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3);
    __half2_raw const h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), __NV_E4M3);
    lo = static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(l.y) << 16);
    hi = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
#endif
}

// Four stored bytes (byte 0 first) -> the f16 pairs (b0, b1) and (b2, b3): the K operand of the 8-bit decode
// path's f16 Q K^T MMA (exact for e4m3 and int8).
template <bool kFp8>
__device__ __forceinline__ void bytes4ToHalfPairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
    if constexpr (kFp8)
        e4m3x4ToHalfPairs(x, lo, hi);
    else
        int8x4ToPairs<__half>(x, lo, hi);
}

// Bytes j of x and of y (two tokens' values of the same 4 dims) -> out[j] = f16 pair (x_j low, y_j high),
// the k pair of a P*V B fragment. f16 whatever the compute type: the decode kernel runs P*V for 8-bit
// caches as an f16 MMA (P is in [0, 1], where f16 is the more precise 16-bit type; 8-bit values are exact
// in f16), so the conversion is one PRMT per two pairs plus one cvt per pair.
template <bool kFp8>
__device__ __forceinline__ void tokenPairsToHalf(uint32_t x, uint32_t y, uint32_t (&out)[4]) {
    uint32_t const p01 = __byte_perm(x, y, 0x5140);  // [x0, y0, x1, y1]
    uint32_t const p23 = __byte_perm(x, y, 0x7362);  // [x2, y2, x3, y3]
    if constexpr (kFp8) {
        e4m3x4ToHalfPairs(p01, out[0], out[1]);
        e4m3x4ToHalfPairs(p23, out[2], out[3]);
    } else {
        int8x4ToPairs<__half>(p01, out[0], out[1]);
        int8x4ToPairs<__half>(p23, out[2], out[3]);
    }
}

// Eight 8-bit stored values -> eight values of type T by bit moves (fp8x4ToPairs / int8x4ToPairs), fp8 vs int8 fixed
// at compile time: the one spelling of the conversion that both entry points below reach.
template <typename T, bool kFp8>
__device__ __forceinline__ uint4 dequant8x8Bits(uint2 raw) {
    uint4 out;
    if constexpr (kFp8) {
        fp8x4ToPairs<T>(raw.x, out.x, out.y);
        fp8x4ToPairs<T>(raw.y, out.z, out.w);
    } else {
        int8x4ToPairs<T>(raw.x, out.x, out.y);
        int8x4ToPairs<T>(raw.y, out.z, out.w);
    }
    return out;
}

// Eight 8-bit stored values -> eight compute-type values (one 16-byte chunk). `isFp8` is uniform per launch.
template <typename CT>
__device__ __forceinline__ uint4 dequant8x8(uint2 raw, bool isFp8) {
    return isFp8 ? dequant8x8Bits<CT, true>(raw) : dequant8x8Bits<CT, false>(raw);
}

// Eight 8-bit stored values -> eight values of type T, fp8 vs int8 fixed at compile time. For f16, fp8 goes through
// the hardware conversion (e4m3x4ToHalfPairs: one instruction a pair where fp8x4ToPairs' bit moves take five), the
// same values for every code the write side stores.
template <typename T, bool kFp8>
__device__ __forceinline__ uint4 dequant8x8As(uint2 raw) {
    if constexpr (kFp8 && std::is_same_v<T, __half>) {
        uint4 out;
        e4m3x4ToHalfPairs(raw.x, out.x, out.y);
        e4m3x4ToHalfPairs(raw.y, out.z, out.w);
        return out;
    } else {
        return dequant8x8Bits<T, kFp8>(raw);
    }
}

}  // namespace attn
}  // namespace pagedkv
