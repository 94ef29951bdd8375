// Executors: one interface over every way a step runs (the twin of `pagedkv.runtime.executor`).
//
//   engine: executor.layout(shape) -> writes the step's engine inputs there -> executor.execute(shape)
//
// An executor owns its KV manager (and, on a device, the pools: kv()) and decides where a step's engine inputs
// live (`layout`: host memory it owns, pinned staging for a device executor, at fixed offsets so that a step
// is one upload). The engine (engine.h) does the bookkeeping — schedule, reserve, write the inputs, commit —
// and the executor runs the step: the KV manager's pending block copies first, then the model; it checks every
// `kv_write_status_{i}` and returns the sampling head's tokens (and logprobs) on the host, nothing more.
//
// | executor             | where                                                         | header           |
// | HostExecutor         | no device: a function (tests, benchmarks) or the caller       | this one         |
// | TensorRT (openTensorRTEngine) | a TensorRT engine, one stream, CUDA graphs for decode | trt_engine.h     |
// | plugins-only (test host) | the two plugins through IPluginV3 enqueue, no TensorRT    | plugins/testhost |
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime {

// What the model computes, read off the engine's I/O (engine_io.h).
struct ModelInfo {
    int32_t vocab = 0;
    int32_t numTopLogprobs = 0;     // N of top_tokens / top_logprobs
    bool explicitPositions = false;  // the engine takes position_ids
    int32_t staticMaxBlocks = 0;     // a static block-table width (rewrite --max-blocks), 0: dynamic
    int32_t numLayers = 0;
};

// The most one step may hold (an engine's optimization profile maxima); 0: unbounded.
struct StepLimits {
    int32_t maxTokens = 0;        // T
    int32_t maxSeqs = 0;          // B
    int32_t maxRows = 0;          // R, logits rows
    int32_t maxPenaltyWidth = 0;  // W
    std::vector<int32_t> maxBlocks;  // [G] block-table columns (empty: unbounded)
};

// One step's sizes (legend: B sequences, T tokens, R logits rows, W penalty width, G pool groups).
struct StepShape {
    int32_t numSeqs = 0, numTokens = 0, numRows = 0, penaltyWidth = 1;
    std::vector<int32_t> maxBlocks;   // [G] the step's pages per sequence at most (MB)
    std::vector<int32_t> tableWidth;  // [G] the columns block_table_g is written with (layout() sets it, >= MB)
    bool decodeOnly = false;          // one token and one logits row per sequence
};

// Where a step's engine inputs go (engine_io.h names); null where the engine has no such input.
struct StepInputBuffers {
    int64_t* inputIds = nullptr;        // [T]
    int32_t* cuQLens = nullptr;         // [B + 1]
    int32_t* pastLens = nullptr;        // [B]
    std::vector<int32_t*> blockTables;  // [G], each [B, tableWidth[g]]
    int32_t* positionIds = nullptr;     // [T] (explicit positions only)
    int32_t* logitsRows = nullptr;      // [R]
    float* samplingParams = nullptr;    // [R, kSamplingFields]
    int32_t* penaltyTokens = nullptr;   // [R, W]
    float* penaltyCounts = nullptr;     // [R, W]
};

// The sampling head's outputs on the host (valid until the executor runs again).
struct StepOutputs {
    int32_t const* nextTokens = nullptr;  // [R]
    float const* nextLogprobs = nullptr;  // [R]
    int32_t const* topTokens = nullptr;   // [R, numTop]
    float const* topLogprobs = nullptr;   // [R, numTop]
    int32_t numTop = 0;
};

class Executor {
public:
    virtual ~Executor();
    virtual KVManager& kv() = 0;
    virtual ModelInfo const& model() const = 0;
    virtual StepLimits const& limits() const = 0;
    // Blocks of group g the executor holds itself (not for requests): the engine's context limit leaves them out.
    virtual int64_t heldBlocks(int32_t group) const {
        (void)group;
        return 0;
    }
    // Where a step of `shape` writes its inputs; sets shape.tableWidth. Throws std::length_error naming the
    // limit a step exceeds.
    virtual StepInputBuffers const& layout(StepShape& shape) = 0;
    // Runs the step whose inputs were written at layout()'s buffers: the KV manager's pending block copies,
    // then the model. Throws KVWriteError when a layer's kv_write_status reports a bad block table.
    virtual StepOutputs execute(StepShape const& shape) = 0;
};

// A layer's kv_write_status record was not clean (step_metadata.h StatusField): the step's tokens of that
// sequence were skipped; nothing was written outside the pool. Python: pagedkv.step.KVWriteError.
class KVWriteError : public std::runtime_error {
public:
    KVWriteError(std::string const& message, int32_t layer, int32_t flags, int32_t seq, int32_t page, int32_t entry);
    ~KVWriteError() override;
    int32_t layer, flags, seq, page, entry;
};
// Throws KVWriteError for the first layer whose record (int32 [kStatusFields] each, `numLayers` of them
// back to back) has a flag set.
void raiseForStatus(int32_t const* records, int32_t numLayers);

// The inputs of a step as HostExecutor holds them (host vectors), for the function that stands in for a model.
struct HostStep {
    StepShape const& shape;
    StepInputBuffers const& inputs;
};
// Fill tokens [R] (and logprobs [R], topTokens / topLogprobs [R * numTop], already sized) for a step.
using HostStepFunction = std::function<void(HostStep const& step, std::vector<int32_t>& tokens,
                                            std::vector<float>& logprobs, std::vector<int32_t>& topTokens,
                                            std::vector<float>& topLogprobs)>;

// An executor without a device: the KV manager's bookkeeping (copies are drained, there is no memory to copy)
// and host vectors for the inputs; `execute` hands them to `function`, which stands in for a model (unit tests,
// benchmarks). Without a function, the caller runs the step itself between Engine::beginStep and endStep (the
// C API's binding does).
class HostExecutor final : public Executor {
public:
    HostExecutor(KVManager kv, ModelInfo model, HostStepFunction function = {}, StepLimits limits = {});
    KVManager& kv() override { return kv_; }
    ModelInfo const& model() const override { return model_; }
    StepLimits const& limits() const override { return limits_; }
    StepInputBuffers const& layout(StepShape& shape) override;
    StepOutputs execute(StepShape const& shape) override;
    StepInputBuffers const& buffers() const { return buffers_; }  // where the last layout() put the inputs
    // The copies the last execute() drained (a device executor would have run them), oldest first.
    std::vector<BlockCopy> const& lastCopies() const { return copies_; }

private:
    KVManager kv_;
    ModelInfo model_;
    HostStepFunction function_;
    StepLimits limits_;
    std::vector<int64_t> inputIds_;
    std::vector<int32_t> cuQLens_, pastLens_, positionIds_, logitsRows_, penaltyTokens_;
    std::vector<std::vector<int32_t>> tables_;
    std::vector<float> samplingParams_, penaltyCounts_;
    StepInputBuffers buffers_;
    std::vector<int32_t> tokens_, topTokens_;
    std::vector<float> logprobs_, topLogprobs_;
    std::vector<BlockCopy> copies_;
};

// Checks a shape against limits (std::length_error naming the input, its size and the limit) and sets
// tableWidth: the static width, else `decodeWidth` for decode steps when given (> 0), else MB.
void fitShape(StepShape& shape, StepLimits const& limits, ModelInfo const& model, int32_t decodeWidth = 0);

}  // namespace pagedkv::runtime
