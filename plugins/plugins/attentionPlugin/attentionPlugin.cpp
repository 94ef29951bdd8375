#include "attentionPlugin/attentionPlugin.h"

#include <cmath>
#include <limits>
#include <string>

#include "common/pluginErrors.h"
#include "common/stepInputs.h"
#include "common/tensorChecks.h"
#include "pagedkv/capabilities.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv {
namespace plugin {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IExprBuilder;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace {
constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int32_t kOutDTypeLikeQ = -1;

// out_dtype's accepted values: -1 (like q), then the capability table's activation dtypes.
std::vector<int32_t> outDTypeValues() {
    std::vector<int32_t> values{kOutDTypeLikeQ};
    for (IODType io : kSupportedIODTypes) values.push_back(static_cast<int32_t>(io));
    return values;
}
}  // namespace

std::vector<FieldSpec> const& attentionFieldSpecs() {
    // AttentionConfig's own fields, in its to_attributes() order.
    static std::vector<FieldSpec> const specs = pluginFieldSpecs({
        FieldSpec::optionalInt("window", 0, kInt32Min, kInt32Max),
        FieldSpec::optionalInt("attention_sinks", 0, 0, kInt32Max),
        FieldSpec::nonNegativeFloat("softmax_scale", 0.f),
        FieldSpec::nonNegativeFloat("logit_softcap", 0.f),
        FieldSpec::flag("q_fp8", false),
        FieldSpec::positiveFloat("q_scale", 1.f),
        FieldSpec::intOneOf("out_dtype", kOutDTypeLikeQ, outDTypeValues(), "-1 like q, 0 fp16, 1 bf16"),
    });
    return specs;
}

AttentionAttributes readAttentionAttributes(FieldValues const& values) {
    AttentionAttributes a{};
    a.numQHeads = values.getInt("num_q_heads");
    a.pool = readPoolAttributes(values, a.numQHeads);
    a.window = values.getInt("window");
    a.attentionSinks = values.getInt("attention_sinks");
    float const scale = values.getFloat("softmax_scale");
    a.softmaxScale = scale > 0.f ? scale : static_cast<float>(1.0 / std::sqrt(double(a.pool.headDim)));
    a.logitSoftcap = values.getFloat("logit_softcap");
    a.qFP8 = values.getFlag("q_fp8");
    a.qScale = values.getFloat("q_scale");
    a.outDType = values.getInt("out_dtype");
    if (a.qFP8 && a.outDType == kOutDTypeLikeQ) {
        // An fp8 query says nothing about the model's dtype: the graph must name it.
        throw PluginError("field 'out_dtype'=-1: q_fp8=1 needs the output dtype, expected 0 (fp16) or 1 (bf16)");
    }
    return a;
}

// ======================================================================================= AttentionPlugin

AttentionPlugin::AttentionPlugin(FieldValues values, nvinfer1::TensorRTPhase phase)
    : PluginV3(std::move(values), phase), mAttrs(readAttentionAttributes(fieldValues())) {}

// ---- IPluginV3OneBuild ---------------------------------------------------------------------------------------

int32_t AttentionPlugin::getNbOutputs() const noexcept { return AttentionIO::kNumOutputs; }

DataType AttentionPlugin::outputType(DataType qType) const {
    return mAttrs.outDType == kOutDTypeLikeQ ? qType : dataTypeOf(static_cast<IODType>(mAttrs.outDType));
}

bool AttentionPlugin::acceptsQType(DataType qType) const {
    if (mAttrs.qFP8) return qType == DataType::kFP8;
    if (qType != DataType::kHALF && qType != DataType::kBF16) return false;
    return mAttrs.outDType == kOutDTypeLikeQ || qType == outputType(qType);  // 16-bit q and out share a type
}

int32_t AttentionPlugin::maxKVLenFor(int64_t maxBlocks) const {
    return checkedInt32(maxBlocks * mAttrs.pool.pageSize, "cache positions MB * page_size");
}

int32_t AttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                            int32_t nbInputs) const noexcept {
    return guarded(kPluginName, "getOutputDataTypes", -1, [&] {
        expectTensorCounts(nbInputs, nbOutputs, AttentionIO::kNumInputs, AttentionIO::kNumOutputs);
        outputTypes[AttentionIO::kOut] = outputType(inputTypes[AttentionIO::kQ]);
        return 0;
    });
}

int32_t AttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                         int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                                         IExprBuilder& exprBuilder) noexcept {
    return guarded(kPluginName, "getOutputShapes", -1, [&] {
        expectTensorCounts(nbInputs, nbOutputs, AttentionIO::kNumInputs, AttentionIO::kNumOutputs);
        if (inputs[AttentionIO::kQ].nbDims != 2) {
            throw PluginError("q: expected rank 2 [T, H * D], got rank " + std::to_string(inputs[AttentionIO::kQ].nbDims));
        }
        auto const* qWidth = exprBuilder.constant(mAttrs.qWidth());
        if (qWidth == nullptr) throw PluginError("IExprBuilder::constant returned null");
        outputs[AttentionIO::kOut].nbDims = 2;
        outputs[AttentionIO::kOut].d[0] = inputs[AttentionIO::kQ].d[0];  // T
        outputs[AttentionIO::kOut].d[1] = qWidth;                         // H * D
        return 0;
    });
}

bool AttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                                int32_t nbOutputs) noexcept {
    return guarded(kPluginName, "supportsFormatCombination", false, [&] {
        expectFormatPosition(pos, nbInputs, nbOutputs, AttentionIO::kNumInputs, AttentionIO::kNumOutputs);
        nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) return false;
        switch (pos) {
            case AttentionIO::kQ: return acceptsQType(desc.type);
            case AttentionIO::kKVPools: return desc.type == DataType::kINT64;
            case AttentionIO::kBlockTable:
            case AttentionIO::kCuQLens:
            case AttentionIO::kPastLens:
            case AttentionIO::kKVWriteStatus: return desc.type == DataType::kINT32;
            default: return desc.type == outputType(inOut[AttentionIO::kQ].desc.type);  // output 0
        }
    });
}

void AttentionPlugin::checkConfiguration(std::vector<Dims> const& inputDims, std::vector<DataType> const& inputTypes,
                                         std::vector<Dims> const& outputDims,
                                         std::vector<DataType> const& outputTypes) const {
    expectTensorCounts(static_cast<int32_t>(inputDims.size()), static_cast<int32_t>(outputDims.size()),
                       AttentionIO::kNumInputs, AttentionIO::kNumOutputs);
    ExtentBinder binder;
    Dims const& q = inputDims[AttentionIO::kQ];
    binder.expectRank("q", q, 2);
    binder.bind("T", "q", q, 0);
    binder.expectExtent("q", q, 1, mAttrs.qWidth(), "num_q_heads * head_dim");
    checkStepMetadataShapes(binder, inputDims, mAttrs.pool.poolIndex);
    Dims const& status = inputDims[AttentionIO::kKVWriteStatus];
    binder.expectRank("kv_write_status", status, 1);
    binder.expectExtent("kv_write_status", status, 0, kStatusFields, "StatusField count");
    Dims const& out = outputDims[AttentionIO::kOut];
    binder.expectRank("output 0", out, 2);
    binder.bind("T", "output 0", out, 0);
    binder.expectExtent("output 0", out, 1, mAttrs.qWidth(), "num_q_heads * head_dim");
    int64_t const maxBlocks = binder.value("MB");
    if (maxBlocks >= 0) maxKVLenFor(maxBlocks);  // MB * P must fit int32

    DataType const qType = inputTypes[AttentionIO::kQ];
    if (mAttrs.qFP8) {
        expectType("q (q_fp8=1)", qType, {DataType::kFP8});
    } else if (mAttrs.outDType != kOutDTypeLikeQ) {
        expectType("q (out_dtype set)", qType, {outputType(qType)});
    } else {
        expectType("q", qType, {DataType::kHALF, DataType::kBF16});
    }
    expectType("kv_pools", inputTypes[AttentionIO::kKVPools], {DataType::kINT64});
    expectType("block_table", inputTypes[AttentionIO::kBlockTable], {DataType::kINT32});
    expectType("cu_q_lens", inputTypes[AttentionIO::kCuQLens], {DataType::kINT32});
    expectType("past_lens", inputTypes[AttentionIO::kPastLens], {DataType::kINT32});
    expectType("kv_write_status", inputTypes[AttentionIO::kKVWriteStatus], {DataType::kINT32});
    expectType("output 0", outputTypes[AttentionIO::kOut], {outputType(qType)});
}

size_t AttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                         DynamicPluginTensorDesc const* /*outputs*/,
                                         int32_t /*nbOutputs*/) const noexcept {
    return guarded(kPluginName, "getWorkspaceSize", size_t(0), [&] {
        if (nbInputs != AttentionIO::kNumInputs) {
            throw PluginError("expected " + std::to_string(AttentionIO::kNumInputs) + " inputs, got " +
                              std::to_string(nbInputs));
        }
        // The profile's maxima bound every step this engine will see; the kernels get actual extents.
        int32_t const maxTokens = checkedInt32(inputs[AttentionIO::kQ].max.d[0], "profile max T");
        int32_t const maxSeqs = checkedInt32(inputs[AttentionIO::kPastLens].max.d[0], "profile max B");
        int32_t const maxKVLen = maxKVLenFor(inputs[AttentionIO::kBlockTable].max.d[1]);
        return attentionWorkspaceBytes(maxTokens, maxSeqs, mAttrs.numQHeads, mAttrs.pool.headDim, maxKVLen,
                                       mAttrs.pool.pageSize);
    });
}

// ---- IPluginV3OneRuntime -------------------------------------------------------------------------------------

int32_t AttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                 void const* const* inputs, void* const* outputs, void* workspace,
                                 cudaStream_t stream) noexcept {
    return guarded(kPluginName, "enqueue", -1, [&] {
        if (isBuildPhase()) return 0;  // tactic timing: q, kv_pools and the block table hold arbitrary data
        // Host-side values come from dimensions only: T (q rows), B, MB. No device-to-host sync.
        StepExtents const extents = stepExtentsOf(inputDesc);
        if (extents.numTokens == 0) return 0;  // an empty step reads nothing

        AttentionParams a{};
        setPoolParams(a, mAttrs.numQHeads, mAttrs.pool);
        a.ioDType = ioDTypeOf("output", outputDesc[AttentionIO::kOut].type);
        a.qFP8 = mAttrs.qFP8;
        a.qScale = mAttrs.qScale;
        a.q = inputs[AttentionIO::kQ];
        a.meta = stepMetadataOf(extents, inputs, mAttrs.pool.poolIndex);
        a.maxQLen = a.meta.numTokens;               // no sequence has more new tokens than the step
        a.maxKVLen = maxKVLenFor(extents.maxBlocks);  // positions the block table can address
        a.window = mAttrs.window;
        a.attentionSinks = mAttrs.attentionSinks;
        a.softmaxScale = mAttrs.softmaxScale;
        a.logitSoftcap = mAttrs.logitSoftcap;
        a.out = outputs[AttentionIO::kOut];
        // Sized for the actual step; never more than getWorkspaceSize gave for the profile's maxima.
        a.workspaceBytes = attentionWorkspaceBytes(a.meta.numTokens, a.meta.numSeqs, a.numQHeads, a.headDim,
                                                   a.maxKVLen, mAttrs.pool.pageSize);
        a.workspace = a.workspaceBytes > 0 ? workspace : nullptr;
        if (a.workspaceBytes > 0 && workspace == nullptr) {
            throw PluginError("workspace is null but " + std::to_string(a.workspaceBytes) + " bytes are needed");
        }
        checkLaunch("launchAttention", launchAttention(a, stream));
        return 0;
    });
}

}  // namespace plugin
}  // namespace pagedkv
