// The step-metadata inputs both plugins take at the same positions (docs/plugin_io.md):
//   1 kv_pools     INT64 [NP, kPoolDescFields]  pool descriptors (device address, block count, reserved)
//   2 block_table  INT32 [B, MB]                physical block of each sequence's page, -1 where none
//   3 cu_q_lens    INT32 [B + 1]                sequence b owns tokens [cu_q_lens[b], cu_q_lens[b+1])
//   4 past_lens    INT32 [B]                    tokens cached before this step
// Position 0 is the plugin's activation input (qkv / q), whose first dimension is T.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <vector>

#include "common/tensorChecks.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv {
namespace plugin {

enum StepInput : int32_t {
    kKVPoolsInput = 1,
    kBlockTableInput = 2,
    kCuQLensInput = 3,
    kPastLensInput = 4,
};

// Host-known extents of a step, read from input dimensions (never from device data: no sync in enqueue).
struct StepExtents {
    int64_t numTokens;   // T
    int64_t numSeqs;     // B
    int64_t maxBlocks;   // MB
    int64_t numPools;    // NP
};

// A tensor's description as TensorRT hands it when configuring (DynamicPluginTensorDesc) or at run time
// (PluginTensorDesc), and the dims / types of n of them.
inline nvinfer1::PluginTensorDesc const& descOf(nvinfer1::DynamicPluginTensorDesc const& d) { return d.desc; }
inline nvinfer1::PluginTensorDesc const& descOf(nvinfer1::PluginTensorDesc const& d) { return d; }
template <typename Desc>
std::vector<nvinfer1::Dims> dimsOf(Desc const* descs, int32_t n) {
    std::vector<nvinfer1::Dims> dims;
    for (int32_t i = 0; i < n; ++i) dims.push_back(descOf(descs[i]).dims);
    return dims;
}
template <typename Desc>
std::vector<nvinfer1::DataType> typesOf(Desc const* descs, int32_t n) {
    std::vector<nvinfer1::DataType> types;
    for (int32_t i = 0; i < n; ++i) types.push_back(descOf(descs[i]).type);
    return types;
}

// Checks ranks and extents of inputs 1..4 and binds B, MB, NP; checks pool_index < NP when NP is known and
// that T > 0 tokens have B > 0 sequences (T bound by the caller from input 0 first).
void checkStepMetadataShapes(ExtentBinder& binder, std::vector<nvinfer1::Dims> const& inputs, int32_t poolIndex);

// Extents from concrete (run-time) descriptors; inputs[0] gives T.
StepExtents stepExtentsOf(nvinfer1::PluginTensorDesc const* inputDesc);

// StepMetadata over the enqueue's input pointers. Throws when pool_index is not a row of kv_pools.
StepMetadata stepMetadataOf(StepExtents const& extents, void const* const* inputs, int32_t poolIndex);

// Checks an input or output is linear and of one of the given types (configurePlugin / onShapeChange).
void expectType(char const* tensor, nvinfer1::DataType got, std::vector<nvinfer1::DataType> const& accepted);

}  // namespace plugin
}  // namespace pagedkv
