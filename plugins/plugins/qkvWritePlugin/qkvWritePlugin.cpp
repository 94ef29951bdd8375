#include "qkvWritePlugin/qkvWritePlugin.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <string>

#include "common/pluginErrors.h"
#include "common/stepInputs.h"
#include "common/tensorChecks.h"
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
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
}  // namespace

std::vector<FieldSpec> const& qkvWriteFieldSpecs() {
    // WriteConfig's own fields, in its to_attributes() order (rope expanded).
    static std::vector<FieldSpec> const specs = pluginFieldSpecs({
        FieldSpec::intOneOf("rope_style", static_cast<int32_t>(RopeStyle::kNeox), {0, 1, 2},
                            "0 none, 1 NeoX, 2 GPT-J"),
        FieldSpec::optionalInt("rope_rotary_dim", 0, 0, 2 * kMaxRotaryPairs),
        FieldSpec::positiveFloat("rope_theta", 10000.f),
        FieldSpec::intOneOf("rope_scaling", static_cast<int32_t>(RopeScaling::kNone), {0, 1, 2, 3, 4},
                            "0 none, 1 linear, 2 llama3, 3 yarn, 4 longrope"),
        FieldSpec::positiveFloat("rope_factor", 1.f),
        FieldSpec::positiveFloat("rope_low_freq_factor", 1.f),
        FieldSpec::positiveFloat("rope_high_freq_factor", 4.f),
        FieldSpec::optionalInt("rope_original_max_positions", 8192, 1, kInt32Max),
        FieldSpec::positiveFloat("rope_beta_fast", 32.f),
        FieldSpec::positiveFloat("rope_beta_slow", 1.f),
        FieldSpec::flag("rope_truncate", true),
        FieldSpec::nonNegativeFloat("rope_attention_factor", 0.f),
        FieldSpec::positiveFloats("rope_short_factors", kMaxRotaryPairs),
        FieldSpec::positiveFloats("rope_long_factors", kMaxRotaryPairs),
        FieldSpec::flag("has_bias", false),
        FieldSpec::flag("explicit_positions", false),
        FieldSpec::flag("zero_v_tail", true),
        FieldSpec::flag("q_out_fp8", false),
        FieldSpec::positiveFloat("q_scale", 1.f),
    });
    return specs;
}

QKVWriteAttributes readQKVWriteAttributes(FieldValues const& values) {
    QKVWriteAttributes a{};
    a.numQHeads = values.getInt("num_q_heads");
    a.pool = readPoolAttributes(values, a.numQHeads);
    a.rope.style = static_cast<RopeStyle>(values.getInt("rope_style"));
    a.rope.rotaryDim = values.getInt("rope_rotary_dim");
    a.rope.theta = values.getFloat("rope_theta");
    a.rope.scaling = static_cast<RopeScaling>(values.getInt("rope_scaling"));
    a.rope.factor = values.getFloat("rope_factor");
    a.rope.lowFreqFactor = values.getFloat("rope_low_freq_factor");
    a.rope.highFreqFactor = values.getFloat("rope_high_freq_factor");
    a.rope.originalMaxPositions = values.getInt("rope_original_max_positions");
    a.rope.betaFast = values.getFloat("rope_beta_fast");
    a.rope.betaSlow = values.getFloat("rope_beta_slow");
    a.rope.truncate = values.getInt("rope_truncate");
    a.rope.attentionFactor = values.getFloat("rope_attention_factor");
    std::vector<float> const& shortFactors = values.getFloats("rope_short_factors");
    std::vector<float> const& longFactors = values.getFloats("rope_long_factors");
    if (shortFactors.size() != longFactors.size()) {
        throw PluginError("fields 'rope_short_factors' (" + std::to_string(shortFactors.size()) +
                          " values) and 'rope_long_factors' (" + std::to_string(longFactors.size()) +
                          " values): expected the same length");
    }
    a.rope.numFactors = static_cast<int32_t>(shortFactors.size());  // <= kMaxRotaryPairs (the field's maximum)
    std::copy(shortFactors.begin(), shortFactors.end(), a.rope.shortFactors);
    std::copy(longFactors.begin(), longFactors.end(), a.rope.longFactors);
    a.hasBias = values.getFlag("has_bias");
    a.explicitPositions = values.getFlag("explicit_positions");
    a.zeroVTail = values.getFlag("zero_v_tail");
    a.qOutFP8 = values.getFlag("q_out_fp8");
    a.qScale = values.getFloat("q_scale");

    if (a.rope.style != RopeStyle::kNone) {
        int32_t const rotary = a.rope.rotaryDim != 0 ? a.rope.rotaryDim : a.pool.headDim;
        if (rotary % 2 != 0 || rotary > a.pool.headDim) {
            throw PluginError("field 'rope_rotary_dim'=" + std::to_string(a.rope.rotaryDim) +
                              ": must be 0 (= head_dim) or even and in (0, head_dim=" +
                              std::to_string(a.pool.headDim) + "]");
        }
        if (a.rope.scaling == RopeScaling::kLlama3 && !(a.rope.highFreqFactor > a.rope.lowFreqFactor)) {
            throw PluginError("field 'rope_high_freq_factor'=" + std::to_string(a.rope.highFreqFactor) +
                              ": must be > rope_low_freq_factor=" + std::to_string(a.rope.lowFreqFactor) +
                              " for llama3 scaling");
        }
    }
    return a;
}

// ======================================================================================== QKVWritePlugin

QKVWritePlugin::QKVWritePlugin(FieldValues values, nvinfer1::TensorRTPhase phase)
    : PluginV3(std::move(values), phase), mAttrs(readQKVWriteAttributes(fieldValues())), mRope{} {
    // The one RopeConfig -> RopeParams conversion (kernels/rope_params.cpp); the kernel sees only its table.
    if (!computeRopeParams(mAttrs.rope, mAttrs.pool.headDim, mRope)) {
        throw PluginError(std::string("rope_* fields: computeRopeParams: ") + lastErrorMessage());
    }
}

// ---- IPluginV3OneBuild ---------------------------------------------------------------------------------------

int32_t QKVWritePlugin::getNbOutputs() const noexcept { return QKVWriteIO::kNumOutputs; }

DataType QKVWritePlugin::qOutputType(DataType qkvType) const { return mAttrs.qOutFP8 ? DataType::kFP8 : qkvType; }

int32_t QKVWritePlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                           int32_t nbInputs) const noexcept {
    return guarded(kPluginName, "getOutputDataTypes", -1, [&] {
        expectTensorCounts(nbInputs, nbOutputs, mAttrs.numInputs(), QKVWriteIO::kNumOutputs);
        outputTypes[QKVWriteIO::kQ] = qOutputType(inputTypes[QKVWriteIO::kQKV]);
        outputTypes[QKVWriteIO::kKVWriteStatus] = DataType::kINT32;
        return 0;
    });
}

int32_t QKVWritePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                        int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                                        IExprBuilder& exprBuilder) noexcept {
    return guarded(kPluginName, "getOutputShapes", -1, [&] {
        expectTensorCounts(nbInputs, nbOutputs, mAttrs.numInputs(), QKVWriteIO::kNumOutputs);
        if (inputs[QKVWriteIO::kQKV].nbDims != 2) {
            throw PluginError("qkv: expected rank 2 [T, (H + 2*KVH) * D], got rank " +
                              std::to_string(inputs[QKVWriteIO::kQKV].nbDims));
        }
        auto const* qWidth = exprBuilder.constant(mAttrs.qWidth());
        auto const* statusFields = exprBuilder.constant(kStatusFields);
        if (qWidth == nullptr || statusFields == nullptr) throw PluginError("IExprBuilder::constant returned null");
        outputs[QKVWriteIO::kQ].nbDims = 2;
        outputs[QKVWriteIO::kQ].d[0] = inputs[QKVWriteIO::kQKV].d[0];  // T
        outputs[QKVWriteIO::kQ].d[1] = qWidth;                          // H * D
        outputs[QKVWriteIO::kKVWriteStatus].nbDims = 1;
        outputs[QKVWriteIO::kKVWriteStatus].d[0] = statusFields;
        return 0;
    });
}

bool QKVWritePlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                               int32_t nbOutputs) noexcept {
    return guarded(kPluginName, "supportsFormatCombination", false, [&] {
        expectFormatPosition(pos, nbInputs, nbOutputs, mAttrs.numInputs(), QKVWriteIO::kNumOutputs);
        nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) return false;
        // Decisions depend on inOut[0..pos] only (TensorRT fills later positions with garbage).
        DataType const qkvType = inOut[QKVWriteIO::kQKV].desc.type;
        if (pos == QKVWriteIO::kQKV) return desc.type == DataType::kHALF || desc.type == DataType::kBF16;
        if (pos == QKVWriteIO::kKVPools) return desc.type == DataType::kINT64;
        if (pos < nbInputs) {
            if (pos == mAttrs.biasIndex()) return desc.type == qkvType;
            return desc.type == DataType::kINT32;  // block_table, cu_q_lens, past_lens, position_ids
        }
        if (pos - nbInputs == QKVWriteIO::kQ) return desc.type == qOutputType(qkvType);
        return desc.type == DataType::kINT32;  // kv_write_status
    });
}

void QKVWritePlugin::checkConfiguration(std::vector<Dims> const& inputDims, std::vector<DataType> const& inputTypes,
                                        std::vector<Dims> const& outputDims,
                                        std::vector<DataType> const& outputTypes) const {
    if (static_cast<int32_t>(inputDims.size()) != mAttrs.numInputs() ||
        static_cast<int32_t>(outputDims.size()) != QKVWriteIO::kNumOutputs) {
        throw PluginError("expected " + std::to_string(mAttrs.numInputs()) +
                          " inputs (explicit_positions=" + std::to_string(mAttrs.explicitPositions) +
                          ", has_bias=" + std::to_string(mAttrs.hasBias) + ") and 2 outputs, got " +
                          std::to_string(inputDims.size()) + " and " + std::to_string(outputDims.size()));
    }
    ExtentBinder binder;
    std::string const qkvWidthWhy = "(num_q_heads + 2*num_kv_heads) * head_dim = (" +
                                    std::to_string(mAttrs.numQHeads) + " + 2*" +
                                    std::to_string(mAttrs.pool.numKVHeads) + ") * " +
                                    std::to_string(mAttrs.pool.headDim);
    Dims const& qkv = inputDims[QKVWriteIO::kQKV];
    binder.expectRank("qkv", qkv, 2);
    binder.bind("T", "qkv", qkv, 0);
    binder.expectExtent("qkv", qkv, 1, mAttrs.qkvWidth(), qkvWidthWhy);
    checkStepMetadataShapes(binder, inputDims, mAttrs.pool.poolIndex);
    if (mAttrs.explicitPositions) {
        Dims const& pos = inputDims[mAttrs.positionIdsIndex()];
        binder.expectRank("position_ids", pos, 1);
        binder.bind("T", "position_ids", pos, 0);
    }
    if (mAttrs.hasBias) {
        Dims const& bias = inputDims[mAttrs.biasIndex()];
        binder.expectRank("bias", bias, 1);
        binder.expectExtent("bias", bias, 0, mAttrs.qkvWidth(), qkvWidthWhy);
    }
    Dims const& q = outputDims[QKVWriteIO::kQ];
    binder.expectRank("q (output 0)", q, 2);
    binder.bind("T", "q (output 0)", q, 0);
    binder.expectExtent("q (output 0)", q, 1, mAttrs.qWidth(), "num_q_heads * head_dim");
    Dims const& status = outputDims[QKVWriteIO::kKVWriteStatus];
    binder.expectRank("kv_write_status (output 1)", status, 1);
    binder.expectExtent("kv_write_status (output 1)", status, 0, kStatusFields, "StatusField count");

    DataType const qkvType = inputTypes[QKVWriteIO::kQKV];
    expectType("qkv", qkvType, {DataType::kHALF, DataType::kBF16});
    expectType("kv_pools", inputTypes[QKVWriteIO::kKVPools], {DataType::kINT64});
    expectType("block_table", inputTypes[QKVWriteIO::kBlockTable], {DataType::kINT32});
    expectType("cu_q_lens", inputTypes[QKVWriteIO::kCuQLens], {DataType::kINT32});
    expectType("past_lens", inputTypes[QKVWriteIO::kPastLens], {DataType::kINT32});
    if (mAttrs.explicitPositions) expectType("position_ids", inputTypes[mAttrs.positionIdsIndex()], {DataType::kINT32});
    if (mAttrs.hasBias) expectType("bias", inputTypes[mAttrs.biasIndex()], {qkvType});
    expectType("q (output 0)", outputTypes[QKVWriteIO::kQ], {qOutputType(qkvType)});
    expectType("kv_write_status (output 1)", outputTypes[QKVWriteIO::kKVWriteStatus], {DataType::kINT32});
}

// ---- IPluginV3OneRuntime -------------------------------------------------------------------------------------

int32_t QKVWritePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
                                void const* const* inputs, void* const* outputs, void* /*workspace*/,
                                cudaStream_t stream) noexcept {
    return guarded(kPluginName, "enqueue", -1, [&] {
        if (isBuildPhase()) return 0;  // tactic timing: kv_pools and the block table hold arbitrary data
        // Everything the host needs comes from dimensions (T, B, MB, NP): no device-to-host sync.
        StepExtents const extents = stepExtentsOf(inputDesc);
        auto* status = static_cast<int32_t*>(outputs[QKVWriteIO::kKVWriteStatus]);
        // The kernel only ever sets flags, so the record starts clean on every step.
        cudaError_t const err = cudaMemsetAsync(status, 0, kStatusFields * sizeof(int32_t), stream);
        if (err != cudaSuccess) throw PluginError(std::string("cudaMemsetAsync(kv_write_status): ") + cudaGetErrorName(err));
        if (extents.numTokens == 0) return 0;  // an empty step writes nothing

        QKVWriteParams p{};
        setPoolParams(p, mAttrs.numQHeads, mAttrs.pool);
        p.ioDType = ioDTypeOf("qkv", inputDesc[QKVWriteIO::kQKV].type);
        p.qkv = inputs[QKVWriteIO::kQKV];
        p.bias = mAttrs.hasBias ? inputs[mAttrs.biasIndex()] : nullptr;
        p.positionIds =
            mAttrs.explicitPositions ? static_cast<int32_t const*>(inputs[mAttrs.positionIdsIndex()]) : nullptr;
        p.meta = stepMetadataOf(extents, inputs, mAttrs.pool.poolIndex);
        p.rope = mRope;
        p.qOut = outputs[QKVWriteIO::kQ];
        p.qOutFP8 = mAttrs.qOutFP8;
        p.qScale = mAttrs.qScale;
        p.zeroVTail = mAttrs.zeroVTail;
        p.status = status;
        checkLaunch("launchQKVWrite", launchQKVWrite(p, stream));
        return 0;
    });
}

}  // namespace plugin
}  // namespace pagedkv
