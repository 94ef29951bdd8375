// pagedkv_struct_layouts(): every struct the C API takes or fills, described field by field
// (pagedkv/struct_description.h) for bindings that build their mirrors from the library
// (src/pagedkv/kernels/_structs.py) instead of copying them by hand. Each list below is checked against its
// struct at compile time where pagedkv_struct_layouts describes it (PKV_DESCRIBE).
#include <string>

#include "capi_attention.h"
#include "capi_write.h"
#include "pagedkv/attention.h"
#include "pagedkv/kv_layout.h"
#include "pagedkv/qkv_write.h"
#include "pagedkv/step_metadata.h"
#include "pagedkv/struct_description.h"
#include "pagedkv_capi.h"

// The nested structs' names in the descriptions.
namespace pagedkv::structdesc {
template <> struct TypeName<KVLayout> { static constexpr char const* value = "KVLayout"; };
template <> struct TypeName<StepMetadata> { static constexpr char const* value = "StepMetadata"; };
template <> struct TypeName<RopeParams> { static constexpr char const* value = "RopeParams"; };
}  // namespace pagedkv::structdesc

namespace {

using namespace pagedkv;
using structdesc::FieldDesc;

constexpr FieldDesc kKVLayout[] = {
    PKV_FIELD(KVLayout, numLayers),   PKV_FIELD(KVLayout, numKVHeads),     PKV_FIELD(KVLayout, pageSize),
    PKV_FIELD(KVLayout, headDim),     PKV_FIELD(KVLayout, pageShift),      PKV_FIELD(KVLayout, pageLayout),
    PKV_FIELD(KVLayout, ringSinkTokens), PKV_FIELD(KVLayout, cyclicLen),   PKV_FIELD(KVLayout, bubbleLen),
    PKV_FIELD(KVLayout, strideBlock), PKV_FIELD(KVLayout, strideLayer),    PKV_FIELD(KVLayout, strideKV),
    PKV_FIELD(KVLayout, strideHead),  PKV_FIELD(KVLayout, strideToken),
};
constexpr FieldDesc kStepMetadata[] = {
    PKV_FIELD(StepMetadata, poolDescs), PKV_FIELD(StepMetadata, poolIndex), PKV_FIELD(StepMetadata, blockTable),
    PKV_FIELD(StepMetadata, maxBlocks), PKV_FIELD(StepMetadata, cuQLens),   PKV_FIELD(StepMetadata, pastLens),
    PKV_FIELD(StepMetadata, numSeqs),   PKV_FIELD(StepMetadata, numTokens),
};
constexpr FieldDesc kRopeConfig[] = {
    PKV_FIELD(RopeConfig, style),         PKV_FIELD(RopeConfig, rotaryDim),      PKV_FIELD(RopeConfig, theta),
    PKV_FIELD(RopeConfig, scaling),       PKV_FIELD(RopeConfig, factor),         PKV_FIELD(RopeConfig, lowFreqFactor),
    PKV_FIELD(RopeConfig, highFreqFactor), PKV_FIELD(RopeConfig, originalMaxPositions),
    PKV_FIELD(RopeConfig, betaFast),      PKV_FIELD(RopeConfig, betaSlow),       PKV_FIELD(RopeConfig, truncate),
    PKV_FIELD(RopeConfig, attentionFactor), PKV_FIELD(RopeConfig, numFactors),   PKV_FIELD(RopeConfig, shortFactors),
    PKV_FIELD(RopeConfig, longFactors),
};
constexpr FieldDesc kRopeParams[] = {
    PKV_FIELD(RopeParams, style),          PKV_FIELD(RopeParams, rotaryDim), PKV_FIELD(RopeParams, mscale),
    PKV_FIELD(RopeParams, longAboveKVLen), PKV_FIELD(RopeParams, invFreq),   PKV_FIELD(RopeParams, longInvFreq),
};
constexpr FieldDesc kQKVWriteParams[] = {
    PKV_FIELD(QKVWriteParams, numQHeads), PKV_FIELD(QKVWriteParams, numKVHeads), PKV_FIELD(QKVWriteParams, headDim),
    PKV_FIELD(QKVWriteParams, ioDType),   PKV_FIELD(QKVWriteParams, qkv),        PKV_FIELD(QKVWriteParams, bias),
    PKV_FIELD(QKVWriteParams, positionIds), PKV_FIELD(QKVWriteParams, meta),     PKV_FIELD(QKVWriteParams, layout),
    PKV_FIELD(QKVWriteParams, cacheDType), PKV_FIELD(QKVWriteParams, layer),     PKV_FIELD(QKVWriteParams, kScale),
    PKV_FIELD(QKVWriteParams, vScale),    PKV_FIELD(QKVWriteParams, rope),       PKV_FIELD(QKVWriteParams, qOut),
    PKV_FIELD(QKVWriteParams, qOutFP8),   PKV_FIELD(QKVWriteParams, qScale),     PKV_FIELD(QKVWriteParams, zeroVTail),
    PKV_FIELD(QKVWriteParams, status),
};
constexpr FieldDesc kAttentionParams[] = {
    PKV_FIELD(AttentionParams, numQHeads),    PKV_FIELD(AttentionParams, numKVHeads),
    PKV_FIELD(AttentionParams, headDim),      PKV_FIELD(AttentionParams, ioDType),
    PKV_FIELD(AttentionParams, qFP8),         PKV_FIELD(AttentionParams, qScale),
    PKV_FIELD(AttentionParams, q),            PKV_FIELD(AttentionParams, meta),
    PKV_FIELD(AttentionParams, maxQLen),      PKV_FIELD(AttentionParams, maxKVLen),
    PKV_FIELD(AttentionParams, layout),       PKV_FIELD(AttentionParams, cacheDType),
    PKV_FIELD(AttentionParams, layer),        PKV_FIELD(AttentionParams, kScale),
    PKV_FIELD(AttentionParams, vScale),       PKV_FIELD(AttentionParams, window),
    PKV_FIELD(AttentionParams, attentionSinks), PKV_FIELD(AttentionParams, softmaxScale),
    PKV_FIELD(AttentionParams, logitSoftcap), PKV_FIELD(AttentionParams, out),
    PKV_FIELD(AttentionParams, workspace),    PKV_FIELD(AttentionParams, workspaceBytes),
};
constexpr FieldDesc kPlanInfo[] = {
    PKV_FIELD(PagedKVAttentionPlanInfo, run_decode),       PKV_FIELD(PagedKVAttentionPlanInfo, run_multi),
    PKV_FIELD(PagedKVAttentionPlanInfo, run_merge),        PKV_FIELD(PagedKVAttentionPlanInfo, decode_grid),
    PKV_FIELD(PagedKVAttentionPlanInfo, multi_grid),       PKV_FIELD(PagedKVAttentionPlanInfo, merge_grid),
    PKV_FIELD(PagedKVAttentionPlanInfo, decode_chunk_len), PKV_FIELD(PagedKVAttentionPlanInfo, multi_chunk_len),
    PKV_FIELD(PagedKVAttentionPlanInfo, partial_chunks),   PKV_FIELD(PagedKVAttentionPlanInfo, max_span),
    PKV_FIELD(PagedKVAttentionPlanInfo, workspace_bytes),  PKV_FIELD(PagedKVAttentionPlanInfo, decode_warps),
};
constexpr FieldDesc kKernelShapes[] = {
    PKV_FIELD(PagedKVAttentionKernelShapes, decode_threads), PKV_FIELD(PagedKVAttentionKernelShapes, decode_smem_bytes),
    PKV_FIELD(PagedKVAttentionKernelShapes, multi_threads),  PKV_FIELD(PagedKVAttentionKernelShapes, multi_smem_bytes),
    PKV_FIELD(PagedKVAttentionKernelShapes, decode_width_smem_bytes),
    PKV_FIELD(PagedKVAttentionKernelShapes, decode_width_threads),
};

}  // namespace

extern "C" const char* pagedkv_struct_layouts(void) {
    static std::string const json = structdesc::describeStructs(
        {PKV_DESCRIBE(KVLayout, kKVLayout), PKV_DESCRIBE(StepMetadata, kStepMetadata),
         PKV_DESCRIBE(RopeConfig, kRopeConfig), PKV_DESCRIBE(RopeParams, kRopeParams),
         PKV_DESCRIBE(QKVWriteParams, kQKVWriteParams), PKV_DESCRIBE(AttentionParams, kAttentionParams),
         PKV_DESCRIBE(PagedKVAttentionPlanInfo, kPlanInfo), PKV_DESCRIBE(PagedKVAttentionKernelShapes, kKernelShapes)});
    return json.c_str();
}
