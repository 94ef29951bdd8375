// PagedKVAttention: paged attention of this step's queries over the pool, read in place through the block
// table (README.md beside this file, docs/plugin_io.md). enqueue fills AttentionParams from the input
// descriptors and calls pagedkv::launchAttention; nothing else.
//
//   T tokens, B sequences, MB block-table width, NP pools, H query heads, KVH KV heads, D head_dim, P page size
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <vector>

#include "common/pluginBase.h"
#include "common/pluginFields.h"
#include "common/pluginNames.h"
#include "common/poolAttributes.h"
#include "pagedkv/attention.h"

namespace pagedkv {
namespace plugin {

// Tensor positions. A runtime work plan, if the attention kernels come to need one, becomes input 6.
struct AttentionIO {
    enum Input : int32_t {
        kQ = 0,              // [T, H * D] fp16|bf16, or fp8 e4m3 when q_fp8 (the write plugin's output 0)
        kKVPools = 1,        // INT64 [NP, 4]
        kBlockTable = 2,     // INT32 [B, MB]
        kCuQLens = 3,        // INT32 [B + 1]
        kPastLens = 4,       // INT32 [B]
        kKVWriteStatus = 5,  // INT32 [4] the same layer's write status: orders write before read; not read
        kNumInputs = 6,
    };
    enum Output : int32_t {
        kOut = 0,  // [T, H * D] fp16|bf16: out_dtype, or q's type when out_dtype = -1
        kNumOutputs = 1,
    };
};

struct AttentionAttributes {
    int32_t numQHeads;
    PoolAttributes pool;
    int32_t window;          // <= 0: full causal
    int32_t attentionSinks;  // with window > 0: the first positions stay visible
    float softmaxScale;      // resolved: the field's 0 means 1/sqrt(head_dim)
    float logitSoftcap;      // > 0: cap * tanh(logits / cap)
    bool qFP8;
    float qScale;
    int32_t outDType;  // -1: like q (only without q_fp8); else an IODType value

    int32_t qWidth() const { return numQHeads * pool.headDim; }
};

std::vector<FieldSpec> const& attentionFieldSpecs();
AttentionAttributes readAttentionAttributes(FieldValues const& values);

class AttentionPlugin final : public PluginV3<AttentionPlugin> {
public:
    static constexpr char const* kPluginName = kAttentionPluginName;

    // Validates every field (throws PluginError); `phase` as createPlugin got it.
    AttentionPlugin(FieldValues values, nvinfer1::TensorRTPhase phase);

    // ---- IPluginV3OneBuild: the plugin's own methods (the shared ones are PluginV3Base's)
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                               nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                            int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override;
    // Split-K partials for the profile's largest step: T_max tokens, B_max sequences, MB_max * P cache positions.
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // ---- IPluginV3OneRuntime
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override;

private:
    void checkConfiguration(std::vector<nvinfer1::Dims> const& inputDims, std::vector<nvinfer1::DataType> const& inputTypes,
                            std::vector<nvinfer1::Dims> const& outputDims,
                            std::vector<nvinfer1::DataType> const& outputTypes) const override;
    // The output's type: out_dtype's, or q's when out_dtype = -1.
    nvinfer1::DataType outputType(nvinfer1::DataType qType) const;
    // Does q's type fit the attributes: fp8 with q_fp8, else fp16|bf16 and, with out_dtype set, that type.
    bool acceptsQType(nvinfer1::DataType qType) const;
    // Cache positions a step with block-table width `maxBlocks` can read: MB * P (int32-checked).
    int32_t maxKVLenFor(int64_t maxBlocks) const;

    AttentionAttributes mAttrs;
};

using AttentionPluginCreator = PluginCreator<AttentionPlugin, attentionFieldSpecs>;

}  // namespace plugin
}  // namespace pagedkv
