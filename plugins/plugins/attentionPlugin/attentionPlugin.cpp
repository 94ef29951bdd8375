#include "attentionPlugin/attentionPlugin.h"

#include <cmath>
#include <limits>
#include <string>

#include "common/pluginErrors.h"
#include "common/pluginNames.h"
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
using nvinfer1::IPluginCapability;
using nvinfer1::IPluginV3;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace {

constexpr char const* kName = kAttentionPluginName;
constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::vector<FieldSpec> makeFieldSpecs() {
    // Order of AttentionConfig(...).to_attributes(): own fields, then the pool's.
    std::vector<FieldSpec> specs{
        numQHeadsFieldSpec(),
        FieldSpec::optionalInt("window", 0, kInt32Min, kInt32Max),
        FieldSpec::optionalInt("attention_sinks", 0, 0, kInt32Max),
        FieldSpec::nonNegativeFloat("softmax_scale", 0.f),
        FieldSpec::nonNegativeFloat("logit_softcap", 0.f),
        FieldSpec::flag("q_fp8", false),
        FieldSpec::positiveFloat("q_scale", 1.f),
    };
    for (FieldSpec& spec : poolFieldSpecs()) specs.push_back(std::move(spec));
    return specs;
}

IODType ioDTypeOf(DataType type) {
    if (type == DataType::kHALF) return IODType::kFP16;
    if (type == DataType::kBF16) return IODType::kBF16;
    throw PluginError(std::string("output: type ") + dataTypeName(type) + ", expected kHALF|kBF16");
}

}  // namespace

std::vector<FieldSpec> const& attentionFieldSpecs() {
    static std::vector<FieldSpec> const specs = makeFieldSpecs();
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
    return a;
}

// ======================================================================================= AttentionPlugin

AttentionPlugin::AttentionPlugin(FieldValues values)
    : mValues(std::move(values)), mAttrs(readAttentionAttributes(mValues)), mSerialized(mValues) {}

// ---- IPluginV3 -----------------------------------------------------------------------------------------------

IPluginCapability* AttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
    return guarded<IPluginCapability*>(kName, "getCapabilityInterface", nullptr, [&]() -> IPluginCapability* {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        throw PluginError("unknown PluginCapabilityType " + std::to_string(static_cast<int32_t>(type)));
    });
}

IPluginV3* AttentionPlugin::clone() noexcept {
    return guarded<IPluginV3*>(kName, "clone", nullptr, [&] { return new AttentionPlugin(mValues); });
}

// ---- IPluginV3OneCore ----------------------------------------------------------------------------------------

char const* AttentionPlugin::getPluginName() const noexcept { return kAttentionPluginName; }
char const* AttentionPlugin::getPluginVersion() const noexcept { return kPluginVersion; }
char const* AttentionPlugin::getPluginNamespace() const noexcept { return kPluginNamespace; }

// ---- IPluginV3OneBuild ---------------------------------------------------------------------------------------

int32_t AttentionPlugin::getNbOutputs() const noexcept { return AttentionIO::kNumOutputs; }

// No attribute names the output dtype yet, so an fp8 q produces fp16 (README "Known gaps").
DataType AttentionPlugin::outputType(DataType qType) const { return mAttrs.qFP8 ? DataType::kHALF : qType; }

int32_t AttentionPlugin::maxKVLenFor(int64_t maxBlocks) const {
    return checkedInt32(maxBlocks * mAttrs.pool.pageSize, "cache positions MB * page_size");
}

int32_t AttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                            int32_t nbInputs) const noexcept {
    return guarded(kName, "getOutputDataTypes", -1, [&] {
        if (nbInputs != AttentionIO::kNumInputs || nbOutputs != AttentionIO::kNumOutputs) {
            throw PluginError("expected 6 inputs and 1 output, got " + std::to_string(nbInputs) + " and " +
                              std::to_string(nbOutputs));
        }
        outputTypes[AttentionIO::kOut] = outputType(inputTypes[AttentionIO::kQ]);
        return 0;
    });
}

int32_t AttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                         int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                                         IExprBuilder& exprBuilder) noexcept {
    return guarded(kName, "getOutputShapes", -1, [&] {
        if (nbInputs != AttentionIO::kNumInputs || nbOutputs != AttentionIO::kNumOutputs) {
            throw PluginError("expected 6 inputs and 1 output, got " + std::to_string(nbInputs) + " and " +
                              std::to_string(nbOutputs));
        }
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
    return guarded(kName, "supportsFormatCombination", false, [&] {
        if (nbInputs != AttentionIO::kNumInputs || nbOutputs != AttentionIO::kNumOutputs || pos < 0 ||
            pos >= nbInputs + nbOutputs) {
            throw PluginError("pos=" + std::to_string(pos) + " with " + std::to_string(nbInputs) + " inputs and " +
                              std::to_string(nbOutputs) + " outputs; expected 6 inputs and 1 output");
        }
        nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) return false;
        switch (pos) {
            case AttentionIO::kQ:
                return mAttrs.qFP8 ? desc.type == DataType::kFP8
                                   : (desc.type == DataType::kHALF || desc.type == DataType::kBF16);
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
    if (inputDims.size() != AttentionIO::kNumInputs || outputDims.size() != AttentionIO::kNumOutputs) {
        throw PluginError("expected 6 inputs and 1 output, got " + std::to_string(inputDims.size()) + " and " +
                          std::to_string(outputDims.size()));
    }
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

int32_t AttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                         DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept {
    return guarded(kName, "configurePlugin", -1, [&] {
        std::vector<DataType> inTypes, outTypes;
        for (int32_t i = 0; i < nbInputs; ++i) inTypes.push_back(in[i].desc.type);
        for (int32_t i = 0; i < nbOutputs; ++i) outTypes.push_back(out[i].desc.type);
        checkConfiguration(dimsOf(in, nbInputs), inTypes, dimsOf(out, nbOutputs), outTypes);
        return 0;
    });
}

size_t AttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                         DynamicPluginTensorDesc const* /*outputs*/,
                                         int32_t /*nbOutputs*/) const noexcept {
    return guarded(kName, "getWorkspaceSize", size_t(0), [&] {
        if (nbInputs != AttentionIO::kNumInputs) {
            throw PluginError("expected 6 inputs, got " + std::to_string(nbInputs));
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

int32_t AttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                                       int32_t nbOutputs) noexcept {
    return guarded(kName, "onShapeChange", -1, [&] {
        std::vector<DataType> inTypes, outTypes;
        for (int32_t i = 0; i < nbInputs; ++i) inTypes.push_back(in[i].type);
        for (int32_t i = 0; i < nbOutputs; ++i) outTypes.push_back(out[i].type);
        checkConfiguration(dimsOf(in, nbInputs), inTypes, dimsOf(out, nbOutputs), outTypes);
        return 0;
    });
}

int32_t AttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                 void const* const* inputs, void* const* outputs, void* workspace,
                                 cudaStream_t stream) noexcept {
    return guarded(kName, "enqueue", -1, [&] {
        // Host-side values come from dimensions only: T (q rows), B, MB. No device-to-host sync.
        StepExtents const extents = stepExtentsOf(inputDesc);
        if (extents.numTokens == 0) return 0;  // an empty step reads nothing

        AttentionParams a{};
        a.numQHeads = mAttrs.numQHeads;
        a.numKVHeads = mAttrs.pool.numKVHeads;
        a.headDim = mAttrs.pool.headDim;
        a.ioDType = ioDTypeOf(outputDesc[AttentionIO::kOut].type);
        a.qFP8 = mAttrs.qFP8;
        a.qScale = mAttrs.qScale;
        a.q = inputs[AttentionIO::kQ];
        a.meta = stepMetadataOf(extents, inputs, mAttrs.pool.poolIndex);
        a.maxQLen = a.meta.numTokens;               // no sequence has more new tokens than the step
        a.maxKVLen = maxKVLenFor(extents.maxBlocks);  // positions the block table can address
        a.layout = mAttrs.pool.layout;
        a.cacheDType = mAttrs.pool.cacheDType;
        a.layer = mAttrs.pool.layerIndex;
        a.kScale = mAttrs.pool.kScale;
        a.vScale = mAttrs.pool.vScale;
        a.window = mAttrs.window;
        a.sinkTokens = mAttrs.attentionSinks;
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
        cudaError_t const err = launchAttention(a, stream);
        if (err != cudaSuccess) {
            throw PluginError(std::string("launchAttention: ") + cudaGetErrorName(err) +
                              (err == cudaErrorInvalidValue ? std::string(": ") + lastErrorMessage() : std::string()));
        }
        return 0;
    });
}

IPluginV3* AttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
    return clone();  // no per-context resources: a full clone is all an execution context needs
}

PluginFieldCollection const* AttentionPlugin::getFieldsToSerialize() noexcept { return mSerialized.get(); }

// ================================================================================ AttentionPluginCreator

AttentionPluginCreator::AttentionPluginCreator() : mFieldNames(attentionFieldSpecs()) {}

IPluginV3* AttentionPluginCreator::createPlugin(char const* name, PluginFieldCollection const* fc,
                                                nvinfer1::TensorRTPhase phase) noexcept {
    return guarded<IPluginV3*>(kName, "createPlugin", nullptr, [&] {
        try {
            return new AttentionPlugin(parseFields(attentionFieldSpecs(), fc, phase, kName));
        } catch (PluginError const& e) {
            throw PluginError(std::string("layer '") + (name ? name : "") + "' (" + phaseName(phase) +
                              " phase): " + e.what());
        }
    });
}

PluginFieldCollection const* AttentionPluginCreator::getFieldNames() noexcept { return mFieldNames.get(); }
char const* AttentionPluginCreator::getPluginName() const noexcept { return kAttentionPluginName; }
char const* AttentionPluginCreator::getPluginVersion() const noexcept { return kPluginVersion; }
char const* AttentionPluginCreator::getPluginNamespace() const noexcept { return kPluginNamespace; }

}  // namespace plugin
}  // namespace pagedkv
