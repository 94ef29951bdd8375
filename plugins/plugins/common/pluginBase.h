// The IPluginV3 plumbing both plugins share, so that a plugin's files hold only what is its own: its tensor
// positions, output types and shapes, accepted formats, configuration check and enqueue.
//
//   PluginV3Base       capabilities, identity, getFieldsToSerialize, attachToContext, and configurePlugin /
//                      onShapeChange, which both hand the configuration to the plugin's checkConfiguration
//   PluginV3<Derived>  adds clone (a new Derived over the same field values)
//   PluginCreator<Plugin, fieldSpecs>  the IPluginCreatorV3One of a plugin and its attribute table
//
// A plugin derives from PluginV3<Itself>, names itself with `static constexpr char const* kPluginName`, takes
// its validated FieldValues and the phase it was created for in a public constructor (throwing PluginError on a
// bad value) and implements the remaining IPluginV3OneBuild / IPluginV3OneRuntime methods plus
// checkConfiguration.
//
// The phase matters in enqueue: TensorRT's builder times a plugin by calling enqueue on the build-phase instance
// with arbitrary input contents (NVIDIA/TensorRT#2552), so kv_pools holds no pool addresses there and the block
// table no blocks. A build-phase instance's enqueue returns at once (enqueueWhileBuilding): it reads no input
// and writes nothing, so nothing is ever reached through a fake address.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "common/pluginErrors.h"
#include "common/pluginFields.h"
#include "common/pluginNames.h"

namespace pagedkv {
namespace plugin {

class PluginV3Base : public nvinfer1::IPluginV3,
                     public nvinfer1::IPluginV3OneCore,
                     public nvinfer1::IPluginV3OneBuild,
                     public nvinfer1::IPluginV3OneRuntime {
public:
    // ---- IPluginV3 (clone: PluginV3<Derived>)
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept final;

    // ---- IPluginV3OneCore
    char const* getPluginName() const noexcept final { return mPluginName; }
    char const* getPluginVersion() const noexcept final { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept final { return kPluginNamespace; }

    // ---- IPluginV3OneBuild (the rest is the plugin's)
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept final;

    // ---- IPluginV3OneRuntime (enqueue is the plugin's)
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept final;
    // No per-context resources: a full clone is all an execution context needs.
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept final;
    // Every field, build and runtime phase alike (the runtime phase's parse requires them all).
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept final { return mSerialized.get(); }

protected:
    // `pluginName` is a string literal (pluginNames.h); `phase` is createPlugin's (a clone keeps it).
    PluginV3Base(char const* pluginName, FieldValues values, nvinfer1::TensorRTPhase phase);

    FieldValues const& fieldValues() const { return mValues; }
    nvinfer1::TensorRTPhase phase() const { return mPhase; }
    // Created with kBUILD (or a clone of one): enqueue returns before it reads an input.
    bool isBuildPhase() const { return mPhase == nvinfer1::TensorRTPhase::kBUILD; }

    // Shapes and types of a configuration (build: -1 dims skipped; run time: all known). Throws PluginError
    // naming the tensor and the value.
    virtual void checkConfiguration(std::vector<nvinfer1::Dims> const& inputDims,
                                    std::vector<nvinfer1::DataType> const& inputTypes,
                                    std::vector<nvinfer1::Dims> const& outputDims,
                                    std::vector<nvinfer1::DataType> const& outputTypes) const = 0;

private:
    // configurePlugin and onShapeChange: checkConfiguration on either TensorRT description of the tensors.
    template <typename Desc>
    int32_t checkDescs(char const* method, Desc const* in, int32_t nbInputs, Desc const* out,
                       int32_t nbOutputs) const noexcept;

    char const* mPluginName;
    FieldValues mValues;
    nvinfer1::TensorRTPhase mPhase;
    FieldCollection mSerialized;
};

template <typename Derived>
class PluginV3 : public PluginV3Base {
public:
    nvinfer1::IPluginV3* clone() noexcept final {
        return guarded<nvinfer1::IPluginV3*>(Derived::kPluginName, "clone", nullptr,
                                             [&] { return new Derived(fieldValues(), phase()); });
    }

protected:
    PluginV3(FieldValues values, nvinfer1::TensorRTPhase phase)
        : PluginV3Base(Derived::kPluginName, std::move(values), phase) {}
};

// createPlugin's body: parses `fc` against `specs` and makes the plugin with `make`. An invalid field is logged
// naming the layer, the phase, the field and the value, and returns nullptr (never throws).
nvinfer1::IPluginV3* createFromFields(char const* pluginName, std::vector<FieldSpec> const& specs,
                                      char const* layerName, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase,
                                      nvinfer1::IPluginV3* (*make)(FieldValues, nvinfer1::TensorRTPhase)) noexcept;

template <typename Plugin, std::vector<FieldSpec> const& (*fieldSpecs)()>
class PluginCreator final : public nvinfer1::IPluginCreatorV3One {
public:
    PluginCreator() : mFieldNames(fieldSpecs()) {}

    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase) noexcept override {
        return createFromFields(Plugin::kPluginName, fieldSpecs(), name, fc, phase, &make);
    }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return mFieldNames.get(); }
    char const* getPluginName() const noexcept override { return Plugin::kPluginName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

private:
    static nvinfer1::IPluginV3* make(FieldValues values, nvinfer1::TensorRTPhase phase) {
        return new Plugin(std::move(values), phase);
    }

    FieldCollection mFieldNames;
};

}  // namespace plugin
}  // namespace pagedkv
