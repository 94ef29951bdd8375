#include "common/poolAttributes.h"

#include <limits>
#include <string>

#include "common/pluginErrors.h"

namespace pagedkv {
namespace plugin {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::vector<FieldSpec> poolFieldSpecs() {
    return {
        FieldSpec::requiredInt("num_kv_heads", 1, kMaxHeads),
        FieldSpec::requiredIntOneOf("head_dim", {64, 128, 256}),
        FieldSpec::requiredInt("page_size", 1, kMaxPageSize),
        FieldSpec::requiredInt("num_layers", 1, kMaxLayers),
        FieldSpec::requiredInt("layer_index", 0, kMaxLayers - 1),
        FieldSpec::optionalInt("pool_index", 0, 0, kMaxPools - 1),
        FieldSpec::intOneOf("cache_dtype", static_cast<int32_t>(CacheDType::kFP16), {0, 1, 2, 3},
                            "0 fp16, 1 bf16, 2 fp8 e4m3, 3 int8; 4 = NVFP4 is reserved, not implemented"),
        FieldSpec::intOneOf("page_layout", static_cast<int32_t>(PageLayout::kHND), {0, 1}, "0 HND, 1 NHD"),
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
    if (p.cyclicLen % p.pageSize != 0) {
        throw PluginError("field 'cyclic_len'=" + std::to_string(p.cyclicLen) +
                          ": must be 0 or a multiple of page_size=" + std::to_string(p.pageSize) +
                          " (the ring is made of whole pages)");
    }
    if (!makeKVLayout(p.numLayers, p.numKVHeads, p.pageSize, p.headDim, p.pageLayout, p.ringSinkTokens, p.cyclicLen,
                      p.layout)) {
        throw PluginError("makeKVLayout rejected the pool geometry (num_layers=" + std::to_string(p.numLayers) +
                          ", num_kv_heads=" + std::to_string(p.numKVHeads) + ", page_size=" +
                          std::to_string(p.pageSize) + ", head_dim=" + std::to_string(p.headDim) +
                          ", ring_sink_tokens=" + std::to_string(p.ringSinkTokens) + ", cyclic_len=" +
                          std::to_string(p.cyclicLen) + ")");
    }
    return p;
}

}  // namespace plugin
}  // namespace pagedkv
