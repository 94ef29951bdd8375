// The capability table (pagedkv/capabilities.h) as text: the phrases error messages use, and the JSON object
// the C API hands to Python (pagedkv.capabilities). Built once from the table, never written out by hand.
#include "pagedkv/capabilities.h"

#include <string>

#include "launch_common.h"

namespace pagedkv {
namespace {

char const* cacheDTypeName(CacheDType c) {
    switch (c) {
        case CacheDType::kFP16: return "fp16";
        case CacheDType::kBF16: return "bf16";
        case CacheDType::kFP8E4M3: return "fp8_e4m3";
        case CacheDType::kINT8: return "int8";
        case CacheDType::kNVFP4: return "nvfp4";
    }
    return "?";
}

char const* ioDTypeName(IODType io) { return io == IODType::kFP16 ? "fp16" : io == IODType::kBF16 ? "bf16" : "?"; }

// "a, b or c" over the table, each entry written by `item`.
template <typename T, size_t N, typename F>
std::string listText(T const (&table)[N], F item) {
    std::string out;
    for (size_t i = 0; i < N; ++i) {
        if (i > 0) out += i + 1 == N ? " or " : ", ";
        out += item(table[i]);
    }
    return out;
}

template <typename T, size_t N>
std::string jsonArray(T const (&table)[N]) {
    std::string out = "[";
    for (size_t i = 0; i < N; ++i) out += (i ? "," : "") + std::to_string(static_cast<int64_t>(table[i]));
    return out + "]";
}

}  // namespace

char const* supportedHeadDimsText() {
    static std::string const text = commaList(kSupportedHeadDims);  // the plugins' and Python's "one of" spelling
    return text.c_str();
}

char const* supportedCacheDTypesText() {
    static std::string const text =
        listText(kSupportedCacheDTypes,
                 [](CacheDType c) {
                     return std::to_string(static_cast<int32_t>(c)) + " (" + cacheDTypeName(c) + ")";
                 }) +
        "; " + std::to_string(static_cast<int32_t>(CacheDType::kNVFP4)) + " (nvfp4) is reserved, not implemented";
    return text.c_str();
}

char const* supportedIODTypesText() {
    static std::string const text = listText(kSupportedIODTypes, [](IODType io) {
        return std::to_string(static_cast<int32_t>(io)) + " (" + ioDTypeName(io) + ")";
    });
    return text.c_str();
}

char const* capabilitiesJson() {
    static std::string const json =
        std::string("{") + "\"head_dims\":" + jsonArray(kSupportedHeadDims) +
        ",\"page_size\":[" + std::to_string(kMinPageSize) + "," + std::to_string(kMaxPageSize) + "]" +
        ",\"cache_dtypes\":" + jsonArray(kSupportedCacheDTypes) + ",\"io_dtypes\":" + jsonArray(kSupportedIODTypes) +
        ",\"page_layouts\":" + jsonArray(kSupportedPageLayouts) + ",\"max_heads\":" + std::to_string(kMaxHeads) +
        ",\"max_layers\":" + std::to_string(kMaxLayers) + ",\"max_pools\":" + std::to_string(kMaxPools) +
        ",\"max_attention_kv_heads\":" + std::to_string(kMaxAttentionKVHeads) +
        ",\"max_rotary_dim\":" + std::to_string(2 * kMaxRotaryPairs) + "}";
    return json.c_str();
}

}  // namespace pagedkv
