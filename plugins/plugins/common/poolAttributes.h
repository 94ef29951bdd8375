// The attributes both plugins share: where a layer's K/V live (src/pagedkv/config.py PoolConfig) and the
// query-head count. One table, one validation, so the write and the read plugin agree on the pool.
#pragma once

#include <cstdint>
#include <vector>

#include "common/pluginFields.h"
#include "pagedkv/kv_layout.h"

namespace pagedkv {
namespace plugin {

struct PoolAttributes {
    int32_t numKVHeads;
    int32_t headDim;
    int32_t pageSize;
    int32_t numLayers;   // layers in the pool group
    int32_t layerIndex;  // this layer within the group
    int32_t poolIndex;   // row of the kv_pools engine input
    CacheDType cacheDType;
    PageLayout pageLayout;
    int32_t ringSinkTokens;  // cyclic cache only
    int32_t cyclicLen;   // 0: linear cache
    float kScale;        // quantized caches: x ~= stored * kScale
    float vScale;
    KVLayout layout;     // from makeKVLayout: the one geometry both sides use
};

// A plugin's whole attribute table, in config.py's to_attributes() order: num_q_heads, the plugin's own
// fields (`ownFields`, in its config's order), then the PoolConfig fields.
std::vector<FieldSpec> pluginFieldSpecs(std::vector<FieldSpec> ownFields);

// Reads and cross-checks the pool fields (heads divisibility, layer index, then the layout's own check,
// kv_layout_check.h) and builds the KVLayout through makeKVLayout. Throws PluginError naming the field and the
// value. The accepted ranges come from the capability table (pagedkv/capabilities.h).
PoolAttributes readPoolAttributes(FieldValues const& values, int32_t numQHeads);

// The head counts and the pool's part of a launcher's parameter struct (QKVWriteParams and AttentionParams
// name these fields alike), filled in one place for both plugins' enqueue.
template <typename LaunchParams>
void setPoolParams(LaunchParams& params, int32_t numQHeads, PoolAttributes const& pool) {
    params.numQHeads = numQHeads;
    params.numKVHeads = pool.numKVHeads;
    params.headDim = pool.headDim;
    params.layout = pool.layout;
    params.cacheDType = pool.cacheDType;
    params.layer = pool.layerIndex;
    params.kScale = pool.kScale;
    params.vScale = pool.vScale;
}

}  // namespace plugin
}  // namespace pagedkv
