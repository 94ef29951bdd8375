#include "common/poolAttributes.h"

#include <limits>
#include <string>

#include "common/pluginErrors.h"
#include "pagedkv/capabilities.h"
#include "pagedkv/kv_layout_check.h"

namespace pagedkv {
namespace plugin {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// A capability table's values as a field's accepted set.
template <typename T, size_t N>
std::vector<int32_t> valuesOf(T const (&table)[N]) {
    std::vector<int32_t> out;
    for (T v : table) out.push_back(static_cast<int32_t>(v));
    return out;
}

std::vector<FieldSpec> poolFieldSpecs() {
    return {
        FieldSpec::requiredInt("num_kv_heads", 1, kMaxHeads),
        FieldSpec::requiredIntOneOf("head_dim", valuesOf(kSupportedHeadDims)),
        FieldSpec::requiredInt("page_size", kMinPageSize, kMaxPageSize),
        FieldSpec::requiredInt("num_layers", 1, kMaxLayers),
        FieldSpec::requiredInt("layer_index", 0, kMaxLayers - 1),
        FieldSpec::optionalInt("pool_index", 0, 0, kMaxPools - 1),
        FieldSpec::intOneOf("cache_dtype", static_cast<int32_t>(CacheDType::kFP16), valuesOf(kSupportedCacheDTypes),
                            supportedCacheDTypesText()),
        FieldSpec::intOneOf("page_layout", static_cast<int32_t>(PageLayout::kHND), valuesOf(kSupportedPageLayouts),
                            "0 HND, 1 NHD"),
        FieldSpec::optionalInt("ring_sink_tokens", 0, 0, kInt32Max),
        FieldSpec::optionalInt("cyclic_len", 0, 0, kInt32Max),
        FieldSpec::positiveFloat("k_scale", 1.f),
        FieldSpec::positiveFloat("v_scale", 1.f),
    };
}

}  // namespace

std::vector<FieldSpec> pluginFieldSpecs(std::vector<FieldSpec> ownFields) {
    std::vector<FieldSpec> specs{FieldSpec::requiredInt("num_q_heads", 1, kMaxHeads)};
    for (FieldSpec& spec : ownFields) specs.push_back(std::move(spec));
    for (FieldSpec& spec : poolFieldSpecs()) specs.push_back(std::move(spec));
    return specs;
}

PoolAttributes readPoolAttributes(FieldValues const& values, int32_t numQHeads) {
    PoolAttributes p{};
    p.numKVHeads = values.getInt("num_kv_heads");
    p.headDim = values.getInt("head_dim");
    p.pageSize = values.getInt("page_size");
    p.numLayers = values.getInt("num_layers");
    p.layerIndex = values.getInt("layer_index");
    p.poolIndex = values.getInt("pool_index");
    p.cacheDType = static_cast<CacheDType>(values.getInt("cache_dtype"));
    p.pageLayout = static_cast<PageLayout>(values.getInt("page_layout"));
    p.ringSinkTokens = values.getInt("ring_sink_tokens");
    p.cyclicLen = values.getInt("cyclic_len");
    p.kScale = values.getFloat("k_scale");
    p.vScale = values.getFloat("v_scale");

    if (numQHeads % p.numKVHeads != 0) {
        throw PluginError("field 'num_q_heads'=" + std::to_string(numQHeads) + ": must be a multiple of num_kv_heads=" +
                          std::to_string(p.numKVHeads));
    }
    if (p.layerIndex >= p.numLayers) {
        throw PluginError("field 'layer_index'=" + std::to_string(p.layerIndex) + ": expected in [0, num_layers=" +
                          std::to_string(p.numLayers) + ")");
    }
    if (FieldIssue const bad = checkKVLayoutGeometry(p.numLayers, p.numKVHeads, p.pageSize, p.headDim, p.pageLayout,
                                                     p.ringSinkTokens, p.cyclicLen)) {
        throw PluginError("field '" + bad.field + "'=" + std::to_string(bad.value) + ": expected " + bad.expected);
    }
    makeKVLayout(p.numLayers, p.numKVHeads, p.pageSize, p.headDim, p.pageLayout, p.ringSinkTokens, p.cyclicLen,
                 p.layout);  // the geometry checked above is what makeKVLayout accepts
    return p;
}

}  // namespace plugin
}  // namespace pagedkv
