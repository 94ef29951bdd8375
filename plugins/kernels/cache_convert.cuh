// Element conversions between compute floats and the pool's storage types, in one place for the write
// side (quantize) and the read side (dequantize). Convention (docs/kv_layout.md):
//   fp16/bf16: stored = round-to-nearest-even(x), scales unused
//   fp8 e4m3 : stored = e4m3(x / scale) with saturation to +-448, round-to-nearest-even
//   int8     : stored = clamp(rint(x / scale), -128, 127)   (rint: round half to even)
//   x ~= float(stored) * scale
// The kernels multiply by a host-computed 1/scale; the numpy reference divides in float64. They can differ
// by one rounding of the pre-quantization value, which the tests allow (one quantization step).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "pagedkv/kv_layout.h"

namespace pagedkv {

// Storage type of each cache dtype.
template <CacheDType D>
struct CacheStorage;
template <>
struct CacheStorage<CacheDType::kFP16> {
    using type = __half;
};
template <>
struct CacheStorage<CacheDType::kBF16> {
    using type = __nv_bfloat16;
};
template <>
struct CacheStorage<CacheDType::kFP8E4M3> {
    using type = __nv_fp8_storage_t;  // uint8 bits of an e4m3 value
};
template <>
struct CacheStorage<CacheDType::kINT8> {
    using type = int8_t;
};

template <CacheDType D>
using cache_t = typename CacheStorage<D>::type;

template <CacheDType D>
constexpr bool kIsQuantized = (D == CacheDType::kFP8E4M3 || D == CacheDType::kINT8);

// x (fp32) -> stored element. `invScale` = 1/scale; ignored for fp16/bf16.
template <CacheDType D>
__device__ __forceinline__ cache_t<D> quantizeElem(float x, float invScale) {
    if constexpr (D == CacheDType::kFP16) {
        return __float2half_rn(x);
    } else if constexpr (D == CacheDType::kBF16) {
        return __float2bfloat16_rn(x);
    } else if constexpr (D == CacheDType::kFP8E4M3) {
        return __nv_cvt_float_to_fp8(x * invScale, __NV_SATFINITE, __NV_E4M3);
    } else {
        float r = rintf(x * invScale);
        r = fminf(fmaxf(r, -128.f), 127.f);
        return static_cast<int8_t>(r);
    }
}

// stored element -> x (fp32). `scale` ignored for fp16/bf16.
template <CacheDType D>
__device__ __forceinline__ float dequantizeElem(cache_t<D> s, float scale) {
    if constexpr (D == CacheDType::kFP16) {
        return __half2float(s);
    } else if constexpr (D == CacheDType::kBF16) {
        return __bfloat162float(s);
    } else if constexpr (D == CacheDType::kFP8E4M3) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(s, __NV_E4M3);
        return __half2float(__half(h)) * scale;
    } else {
        return static_cast<float>(s) * scale;
    }
}

// Compute-side (q, qkv, out) element type by IODType, for loads and stores of activations.
template <typename T>
__device__ __forceinline__ float toFloat(T v);
template <>
__device__ __forceinline__ float toFloat<__half>(__half v) {
    return __half2float(v);
}
template <>
__device__ __forceinline__ float toFloat<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) {
    return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

}  // namespace pagedkv
