#include "common/pluginBase.h"

#include <string>
#include <utility>

#include "common/stepInputs.h"

namespace pagedkv {
namespace plugin {

using nvinfer1::IPluginCapability;
using nvinfer1::IPluginV3;
using nvinfer1::PluginCapabilityType;

PluginV3Base::PluginV3Base(char const* pluginName, FieldValues values, nvinfer1::TensorRTPhase phase)
    : mPluginName(pluginName), mValues(std::move(values)), mPhase(phase), mSerialized(mValues) {}

IPluginCapability* PluginV3Base::getCapabilityInterface(PluginCapabilityType type) noexcept {
    return guarded<IPluginCapability*>(mPluginName, "getCapabilityInterface", nullptr, [&]() -> IPluginCapability* {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        throw PluginError("unknown PluginCapabilityType " + std::to_string(static_cast<int32_t>(type)));
    });
}

template <typename Desc>
int32_t PluginV3Base::checkDescs(char const* method, Desc const* in, int32_t nbInputs, Desc const* out,
                                 int32_t nbOutputs) const noexcept {
    return guarded(mPluginName, method, -1, [&] {
        checkConfiguration(dimsOf(in, nbInputs), typesOf(in, nbInputs), dimsOf(out, nbOutputs),
                           typesOf(out, nbOutputs));
        return 0;
    });
}

int32_t PluginV3Base::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                      nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept {
    return checkDescs("configurePlugin", in, nbInputs, out, nbOutputs);
}

int32_t PluginV3Base::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                                    nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept {
    return checkDescs("onShapeChange", in, nbInputs, out, nbOutputs);
}

IPluginV3* PluginV3Base::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept { return clone(); }

IPluginV3* createFromFields(char const* pluginName, std::vector<FieldSpec> const& specs, char const* layerName,
                            nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase,
                            IPluginV3* (*make)(FieldValues, nvinfer1::TensorRTPhase)) noexcept {
    return guarded<IPluginV3*>(pluginName, "createPlugin", nullptr, [&] {
        try {
            if (phase != nvinfer1::TensorRTPhase::kBUILD && phase != nvinfer1::TensorRTPhase::kRUNTIME) {
                throw PluginError("TensorRTPhase " + std::to_string(static_cast<int32_t>(phase)) +
                                  ": expected kBUILD (0) or kRUNTIME (1)");
            }
            return make(parseFields(specs, fc, phase, pluginName), phase);
        } catch (PluginError const& e) {
            throw PluginError(std::string("layer '") + (layerName ? layerName : "") + "' (" + phaseName(phase) +
                              " phase): " + e.what());
        }
    });
}

}  // namespace plugin
}  // namespace pagedkv
