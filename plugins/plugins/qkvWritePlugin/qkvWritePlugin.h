// PagedKVQKVWrite: fused QKV bias + RoPE + quantize + paged KV write (README.md beside this file,
// docs/plugin_io.md). enqueue zeroes kv_write_status and calls pagedkv::launchQKVWrite; nothing else.
//
//   T tokens, B sequences, MB block-table width, NP pools, H query heads, KVH KV heads, D head_dim
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <vector>

#include "common/pluginBase.h"
#include "common/pluginFields.h"
#include "common/pluginNames.h"
#include "common/poolAttributes.h"
#include "pagedkv/qkv_write.h"

namespace pagedkv {
namespace plugin {

// Tensor positions. Optional inputs follow the fixed ones in this order, present ones only:
// position_ids (explicit_positions=1), then bias (has_bias=1).
struct QKVWriteIO {
    enum Input : int32_t {
        kQKV = 0,           // [T, (H + 2*KVH) * D] fp16|bf16
        kKVPools = 1,       // INT64 [NP, 4]
        kBlockTable = 2,    // INT32 [B, MB]
        kCuQLens = 3,       // INT32 [B + 1]
        kPastLens = 4,      // INT32 [B]
        kFirstOptional = 5  // position_ids INT32 [T], then bias [(H + 2*KVH) * D] like qkv
    };
    enum Output : int32_t {
        kQ = 0,              // [T, H * D] like qkv, or fp8 e4m3 when q_out_fp8
        kKVWriteStatus = 1,  // INT32 [4] (step_metadata.h StatusField)
        kNumOutputs = 2,
    };
};

struct QKVWriteAttributes {
    int32_t numQHeads;
    PoolAttributes pool;
    RopeConfig rope;
    bool hasBias;
    bool explicitPositions;
    bool zeroVTail;
    bool qOutFP8;
    float qScale;

    int32_t qkvWidth() const { return (numQHeads + 2 * pool.numKVHeads) * pool.headDim; }
    int32_t qWidth() const { return numQHeads * pool.headDim; }
    int32_t numInputs() const { return QKVWriteIO::kFirstOptional + int32_t(explicitPositions) + int32_t(hasBias); }
    int32_t positionIdsIndex() const { return explicitPositions ? int32_t(QKVWriteIO::kFirstOptional) : -1; }
    int32_t biasIndex() const {
        return hasBias ? QKVWriteIO::kFirstOptional + int32_t(explicitPositions) : -1;
    }
};

// The attribute table (names == WriteConfig(...).to_attributes() keys) and its cross-field validation.
std::vector<FieldSpec> const& qkvWriteFieldSpecs();
QKVWriteAttributes readQKVWriteAttributes(FieldValues const& values);

class QKVWritePlugin final : public PluginV3<QKVWritePlugin> {
public:
    static constexpr char const* kPluginName = kQKVWritePluginName;

    // Validates every field (throws PluginError) and precomputes the RoPE table; `phase` as createPlugin got it.
    QKVWritePlugin(FieldValues values, nvinfer1::TensorRTPhase phase);

    // ---- IPluginV3OneBuild: the plugin's own methods (the shared ones are PluginV3Base's)
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                               nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                            int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override;

    // ---- IPluginV3OneRuntime
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override;

private:
    void checkConfiguration(std::vector<nvinfer1::Dims> const& inputDims, std::vector<nvinfer1::DataType> const& inputTypes,
                            std::vector<nvinfer1::Dims> const& outputDims,
                            std::vector<nvinfer1::DataType> const& outputTypes) const override;
    nvinfer1::DataType qOutputType(nvinfer1::DataType qkvType) const;

    QKVWriteAttributes mAttrs;
    RopeParams mRope;
};

using QKVWritePluginCreator = PluginCreator<QKVWritePlugin, qkvWriteFieldSpecs>;

}  // namespace plugin
}  // namespace pagedkv
