// The plugins-only executor: a DeviceExecutor (pagedkv/runtime/device.h: the runtime's own pools, staged step
// upload, decode padding and CUDA graphs) whose "model" is, per layer, the QKV-write plugin then the attention
// plugin, reached through IPluginV3 exactly as an engine reaches them — createPlugin (build) -> output types and
// shapes -> supportsFormatCombination -> configurePlugin and getWorkspaceSize over the executor's step limits ->
// getFieldsToSerialize -> createPlugin (runtime) -> attachToContext, once; then per launch onShapeChange and
// enqueue on the executor's stream (inside a CUDA-graph capture for decode buckets).
//
// The model around the plugins is a test's: a token's QKV row of layer l is token_rows[l][id] + position_rows[l]
// [position] (float32 tables, rounded to the I/O type), uploaded before every launch to a fixed buffer the
// captured graphs read; the sampling head picks (id of the row's last token * 7 + row * 3 + 5) % vocab on the
// host. Both plugins' outputs (q, attention out) stay at fixed device buffers for the caller to read after a step.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "json.h"
#include "pagedkv/runtime/device.h"
#include "pluginLibrary.h"

namespace testhost {

struct PluginsModel {
    int32_t numLayers = 0, vocab = 0, qkvWidth = 0, maxPosition = 0;
    nvinfer1::DataType ioType = nvinfer1::DataType::kHALF;
    std::vector<float> tokenRows;     // [L, vocab, qkvWidth]
    std::vector<float> positionRows;  // [L, maxPosition, qkvWidth]
    std::vector<Json> writeAttrs, attentionAttrs;  // [L] the plugins' ONNX attributes
};

class PluginsExecutor final : public pagedkv::runtime::DeviceExecutor {
public:
    PluginsExecutor(PluginLibrary& library, PluginsModel model, std::vector<pagedkv::runtime::PoolGroup> groups,
                    pagedkv::runtime::StepLimits limits, pagedkv::runtime::DeviceOptions const& options);
    ~PluginsExecutor() override;

    pagedkv::runtime::StepOutputs execute(pagedkv::runtime::StepShape const& shape) override;

    // The engine inputs of the last step as the engine wrote them (before decode padding) and its real shape.
    pagedkv::runtime::StepInputBuffers const& stepInputs() const { return hostInputs(); }
    // Model enqueues of the last execute(): 1 eager, 2 eager then captured, 0 a CUDA-graph replay.
    int32_t lastEnqueues() const { return lastEnqueues_; }
    // Device -> host (synchronous) copy of the first `rows` rows of layer l's q or attention output.
    std::vector<uint16_t> readQ(int32_t layer, int32_t rows) const;
    std::vector<uint16_t> readOut(int32_t layer, int32_t rows) const;
    int32_t qWidth() const { return qWidth_; }

protected:
    void enqueue(pagedkv::runtime::StepShape const& run) override;
    void setShapes(pagedkv::runtime::StepShape const& run) override;
    pagedkv::runtime::StepOutputs results(pagedkv::runtime::StepShape const& run) override;

private:
    struct Stage {  // one plugin of one layer, as an execution context holds it
        PluginPtr build, deserialized, runtime;
        nvinfer1::IPluginV3OneRuntime* run = nullptr;
        std::vector<nvinfer1::DataType> inTypes, outTypes;
        std::vector<void const*> inputs;
        std::vector<void*> outputs;
        std::vector<nvinfer1::PluginTensorDesc> inDesc, outDesc;
        std::vector<nvinfer1::Dims> outMax;  // output dims at the limits' maxima
    };
    Stage makeStage(nvinfer1::IPluginCreatorV3One* creator, Json const& attrs, std::vector<nvinfer1::Dims> inMin,
                    std::vector<nvinfer1::Dims> inMax, std::vector<nvinfer1::DataType> inTypes);
    std::vector<nvinfer1::Dims> runDims(pagedkv::runtime::StepShape const& run, bool attention) const;
    std::vector<uint16_t> read(void const* device, int32_t rows) const;

    PluginsModel model_;
    int32_t qWidth_ = 0;
    std::vector<Stage> write_, attention_;  // [L]
    std::vector<void*> qkv_, q_, out_;      // [L] device, maxTokens rows each
    void* qkvStaging_ = nullptr;            // pinned, [L, maxTokens, qkvWidth] of the I/O type
    void* workspace_ = nullptr;
    size_t workspaceBytes_ = 0;
    std::vector<int32_t> tokens_;
    std::vector<float> logprobs_;
    int32_t lastEnqueues_ = 0;
};

}  // namespace testhost
