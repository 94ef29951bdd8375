#include "common/stepInputs.h"

#include <string>

#include "common/pluginErrors.h"

namespace pagedkv {
namespace plugin {

void checkStepMetadataShapes(ExtentBinder& binder, std::vector<nvinfer1::Dims> const& inputs, int32_t poolIndex) {
    nvinfer1::Dims const& pools = inputs[kKVPoolsInput];
    binder.expectRank("kv_pools", pools, 2);
    binder.expectExtent("kv_pools", pools, 1, kPoolDescFields, "pool descriptor fields, step_metadata.h");
    binder.bind("NP", "kv_pools", pools, 0);
    int64_t const numPools = binder.value("NP");
    if (numPools >= 0 && poolIndex >= numPools) {
        throw PluginError("kv_pools dims " + dimsToString(pools) + ": field 'pool_index'=" +
                          std::to_string(poolIndex) + " is not a row of it (" + std::to_string(numPools) +
                          " pools)");
    }

    nvinfer1::Dims const& table = inputs[kBlockTableInput];
    binder.expectRank("block_table", table, 2);
    binder.bind("B", "block_table", table, 0);
    binder.bind("MB", "block_table", table, 1);

    nvinfer1::Dims const& cuQLens = inputs[kCuQLensInput];
    binder.expectRank("cu_q_lens", cuQLens, 1);
    binder.bind("B", "cu_q_lens", cuQLens, 0, /*offset=*/1);

    nvinfer1::Dims const& pastLens = inputs[kPastLensInput];
    binder.expectRank("past_lens", pastLens, 1);
    binder.bind("B", "past_lens", pastLens, 0);

    // Tokens must belong to some sequence (callers bind T from input 0 before this).
    if (binder.value("T") > 0 && binder.value("B") == 0) {
        throw PluginError("block_table dims " + dimsToString(table) + ": no sequences (B = 0) for T = " +
                          std::to_string(binder.value("T")) + " tokens");
    }
}

StepExtents stepExtentsOf(nvinfer1::PluginTensorDesc const* inputDesc) {
    StepExtents e{};
    e.numTokens = inputDesc[0].dims.d[0];
    e.numSeqs = inputDesc[kBlockTableInput].dims.d[0];
    e.maxBlocks = inputDesc[kBlockTableInput].dims.d[1];
    e.numPools = inputDesc[kKVPoolsInput].dims.d[0];
    return e;
}

StepMetadata stepMetadataOf(StepExtents const& extents, void const* const* inputs, int32_t poolIndex) {
    if (poolIndex >= extents.numPools) {
        throw PluginError("field 'pool_index'=" + std::to_string(poolIndex) + " is not a row of kv_pools (" +
                          std::to_string(extents.numPools) + " pools)");
    }
    StepMetadata meta{};
    meta.poolDescs = static_cast<int64_t const*>(inputs[kKVPoolsInput]);
    meta.poolIndex = poolIndex;
    meta.blockTable = static_cast<int32_t const*>(inputs[kBlockTableInput]);
    meta.maxBlocks = checkedInt32(extents.maxBlocks, "block_table width MB");
    meta.cuQLens = static_cast<int32_t const*>(inputs[kCuQLensInput]);
    meta.pastLens = static_cast<int32_t const*>(inputs[kPastLensInput]);
    meta.numSeqs = checkedInt32(extents.numSeqs, "sequences B");
    meta.numTokens = checkedInt32(extents.numTokens, "tokens T");
    return meta;
}

void expectType(char const* tensor, nvinfer1::DataType got, std::vector<nvinfer1::DataType> const& accepted) {
    for (nvinfer1::DataType t : accepted) {
        if (t == got) return;
    }
    std::string list;
    for (nvinfer1::DataType t : accepted) list += (list.empty() ? "" : "|") + std::string(dataTypeName(t));
    throw PluginError(std::string(tensor) + ": type " + dataTypeName(got) + ", expected " + list);
}

}  // namespace plugin
}  // namespace pagedkv
