// What the kernels support: the ONE table of supported values and limits. The launchers' validation
// (kernels/qkv_write.cu, kernels/attention_plan.cpp), the attention dispatch (kernels/attention_dispatch.cuh),
// the plugins' attribute ranges (plugins/plugins/common/poolAttributes.cpp, qkvWritePlugin.cpp) and the C API
// (pagedkv_capabilities(), which Python's pagedkv.capabilities and pagedkv.config read) all take their sets
// from here; nothing else spells them out.
//
// Adding a head dim: insert it into kSupportedHeadDims (ascending). The attention kernels are then instantiated
// for it (attention_dispatch.cuh walks this table); the static_asserts beside each kernel family and the write
// kernel's plan (qkv_write.cu) say what else the new value needs. Any multiple of 16 up to 256 fits the kernels'
// shapes (a head row is whole 16-byte chunks in every cache dtype, MMA k-steps are 16 dims); head dims that are
// not 64, 128 or 256 keep their shared-memory tiles in rows of the next of those widths (tileRowElems,
// kernels/attention_schedule.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedkv/kv_layout.h"  // CacheDType, PageLayout

namespace pagedkv {

// dtype of the activations the kernels read and write: qkv, bias and q (write side), q and out (attention).
// The values are the C API's `io_dtype` (Python: pagedkv.kernels.write.IODType).
enum class IODType : int32_t { kFP16 = 0, kBF16 = 1 };

// ---- the table -------------------------------------------------------------------------------------------
// Head dims D the kernels are compiled for (attribute `head_dim`).
inline constexpr int32_t kSupportedHeadDims[] = {32, 64, 80, 96, 128, 256};
// Page sizes P (attribute `page_size`): any P in [kMinPageSize, kMaxPageSize], power of two or not. The
// plugins enforce the upper bound (it keeps every derived size inside int32); the launchers need P >= 1.
inline constexpr int32_t kMinPageSize = 1;
inline constexpr int32_t kMaxPageSize = 4096;
// Pool storage dtypes with a kernel (attribute `cache_dtype`); CacheDType::kNVFP4 is reserved, not implemented.
inline constexpr CacheDType kSupportedCacheDTypes[] = {CacheDType::kFP16, CacheDType::kBF16, CacheDType::kFP8E4M3,
                                                       CacheDType::kINT8};
inline constexpr IODType kSupportedIODTypes[] = {IODType::kFP16, IODType::kBF16};
inline constexpr PageLayout kSupportedPageLayouts[] = {PageLayout::kHND, PageLayout::kNHD};
// Attribute bounds the plugins enforce so that every derived size stays inside int32 (e.g. (H + 2*KVH) * D).
inline constexpr int32_t kMaxHeads = 1024;   // num_q_heads and num_kv_heads
inline constexpr int32_t kMaxLayers = 4096;  // num_layers of a pool group
inline constexpr int32_t kMaxPools = 65536;  // pool_index < kMaxPools
// The attention kernels put the KV heads on grid.y.
inline constexpr int32_t kMaxAttentionKVHeads = 65535;

// ---- derived from the table --------------------------------------------------------------------------------
template <typename T, size_t N>
constexpr bool tableContains(T const (&table)[N], T value) {
    for (size_t i = 0; i < N; ++i)
        if (table[i] == value) return true;
    return false;
}
template <typename T, size_t N>
constexpr T tableMax(T const (&table)[N]) {
    T m = table[0];
    for (size_t i = 1; i < N; ++i) m = table[i] > m ? table[i] : m;
    return m;
}

constexpr bool isSupportedHeadDim(int32_t headDim) { return tableContains(kSupportedHeadDims, headDim); }
constexpr bool isSupportedCacheDType(CacheDType c) { return tableContains(kSupportedCacheDTypes, c); }
constexpr bool isSupportedIODType(IODType io) { return tableContains(kSupportedIODTypes, io); }
constexpr bool isSupportedPageLayout(PageLayout l) { return tableContains(kSupportedPageLayouts, l); }

inline constexpr int32_t kMaxHeadDim = tableMax(kSupportedHeadDims);
// RoPE pairs of the widest head (full rotary): the size of the write kernel's frequency tables.
inline constexpr int32_t kMaxRotaryPairs = kMaxHeadDim / 2;

// ---- the same table as text (host; kernels/capabilities.cpp) -----------------------------------------------
// For error messages: "32, 64, 80, 96, 128, 256", "0 (fp16), 1 (bf16), 2 (fp8_e4m3) or 3 (int8)", "0 (fp16) or 1 (bf16)".
char const* supportedHeadDimsText();
char const* supportedCacheDTypesText();
char const* supportedIODTypesText();
// The whole table as one JSON object (the C API's pagedkv_capabilities()); keys are snake_case.
char const* capabilitiesJson();

}  // namespace pagedkv
